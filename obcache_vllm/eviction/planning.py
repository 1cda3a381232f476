"""Block arithmetic of eviction and the messages between scheduler and worker (stdlib only).

Right-aligned compaction. Block ``i`` of a request always holds the logical
token slots ``[i*bs, (i+1)*bs)``; vLLM allocates by length, so the block list stays positional.
After eviction the request's first ``dead`` blocks are *dead* (replaced by vLLM's null block and
returned to the pool) and its ``resident = L - dead*bs`` kept tokens fill the logical slots
``[dead*bs, L)`` without holes::

    logical slots   0        bs       2bs      3bs      4bs   L
                    |  dead  |  dead  | kept.. | kept.. | kept|new tokens ->
    block list      [ null   , null   , b7     , b9     , b12 ]

Attention reads use the block list shifted left by ``dead`` and ``seq_len - dead*bs``; the
positions RoPE sees, the slot mapping of new tokens and the sampler stay logical.

Budget rule: an order is issued only when at least one whole block can go, and the kept count
``K = L - dead_after*bs`` satisfies ``budget <= K < budget + bs`` (the partial head block is the
price of freeing whole blocks; it costs no memory the request would not hold anyway).
"""

from __future__ import annotations

from obcache_vllm.eviction.messages import EvictionOrder


def plan_eviction(
    *, logical_len: int, budget: int, dead_blocks: int, block_size: int
) -> EvictionOrder | None:
    """The order that brings a request back to its budget, or ``None`` if no block can go.

    ``logical_len`` is the number of tokens whose KV is in the cache at the end of this step.
    """
    if block_size <= 0 or budget <= 0:
        raise ValueError("block_size and budget must be positive")
    resident = logical_len - dead_blocks * block_size
    if resident < 0:
        raise ValueError(f"dead blocks {dead_blocks} exceed the logical length {logical_len}")
    if resident - budget < block_size:
        return None
    dead_after = (logical_len - budget) // block_size
    return EvictionOrder(
        logical_len=logical_len,
        dead_before=dead_blocks,
        dead_after=dead_after,
        block_size=block_size,
    )


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def peak_blocks(
    *,
    prompt_len: int,
    max_tokens: int,
    block_size: int,
    chunk: int,
    budget: int | None = None,
    decode: bool = False,
    prefill_evict: bool = False,
    point: int | None = None,
) -> int:
    """The most KV blocks a request can hold at once, over its whole life (worst case).

    The KV of ``prompt_len + max_tokens - 1`` tokens is computed at most (the last token's is
    never needed). ``budget=None``: a stock request, all of it. With a budget, the prompt is
    held whole until the eviction at its compress point ``point`` (default: the prompt's
    end), unless ``prefill_evict``: then a prefill step before the point holds the kept
    tokens (< budget + bs) plus one chunk of at most ``chunk`` tokens. The prompt's tail
    after the point is computed on the compressed cache and kept whole (no order runs
    during it): the prompt ends with ``kept + tail`` tokens. After the prompt these grow by
    the generated ones, or, with ``decode``, fall back under budget + bs (+ one block of
    alignment) at the first decode step.
    """
    bs = block_size
    total = prompt_len + max(max_tokens, 1) - 1
    point = prompt_len if point is None else point
    if budget is None or budget >= point and not decode:
        return _cdiv(total, bs)
    kept = min(point, budget + bs - 1) + prompt_len - point  # resident when the prompt ends
    prompt_blocks = _cdiv(prompt_len, bs)
    if prefill_evict:
        before = min(_cdiv(point, bs), _cdiv(budget + bs - 1 + chunk, bs))
        prompt_blocks = max(before, _cdiv(kept, bs))
    generated = max(max_tokens, 1) - 1
    if decode:
        bounded = max(_cdiv(budget + bs, bs) + 1, _cdiv(kept + 1, bs))
        after = min(_cdiv(kept + generated, bs), bounded)
    else:
        after = _cdiv(kept + generated, bs)
    return max(prompt_blocks, after)
