"""Block arithmetic of eviction and the messages between scheduler and worker (stdlib only).

Right-aligned compaction (DESIGN.md §4). Block ``i`` of a request always holds the logical
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

from dataclasses import dataclass, field

# Extra attributes carrying the messages: on SchedulerOutput (orders, dict req_id -> order) and
# on ModelRunnerOutput (report). Both objects are pickled between EngineCore and worker
# processes, and pickling keeps instance attributes.
ORDERS_ATTR = "obcache_orders"
REPORT_ATTR = "obcache_report"
# On SchedulerOutput: requests whose eviction the scheduler stopped (the worker stops scoring).
DISABLED_ATTR = "obcache_disabled"
# EngineCoreOutput.kv_transfer_params key carrying a budgeted request's KV outcome to the
# front-end, and the SchedulerStats field carrying the eviction counters (see vllm_ext).
OUTCOME_KEY = "obcache"
STATS_ATTR = "obcache"


@dataclass(frozen=True)
class EvictionOrder:
    """Scheduler -> worker, for one request in one step.

    The worker applies it in every attention layer of the step, after that layer's attention:
    it keeps ``kept`` tokens per KV head out of the ``logical_len - dead_before*bs`` resident ones
    and writes them to the logical slots ``[dead_after*bs, logical_len)``. The scheduler frees
    blocks ``[dead_before, dead_after)`` in the same step's ``update_from_output``.
    """

    logical_len: int
    dead_before: int
    dead_after: int
    block_size: int

    @property
    def resident_before(self) -> int:
        return self.logical_len - self.dead_before * self.block_size

    @property
    def kept(self) -> int:
        return self.logical_len - self.dead_after * self.block_size

    @property
    def blocks_freed(self) -> int:
        return self.dead_after - self.dead_before

    @property
    def tokens_evicted(self) -> int:
        return self.resident_before - self.kept


@dataclass(frozen=True)
class RowState:
    """A budgeted request's cumulative eviction state as the worker holds it after a step."""

    dead: int
    evictions: int
    tokens_evicted: int
    # Prompt tokens left by the prefill eviction (None: no prefill eviction yet).
    kept_prompt: int | None = None


@dataclass(frozen=True)
class RowFailure:
    """A fault contained to one request. ``fatal``: its cache is torn (some layers compacted,
    others not), so the request must be finished with an error; otherwise it goes on
    uncompressed. ``stage`` and ``reason`` label the failure counter."""

    req_id: str
    stage: str
    reason: str
    fatal: bool = False


@dataclass(frozen=True)
class EvictionReport:
    """Worker -> scheduler, once per step with budgeted requests.

    ``states`` holds the cumulative state of every budgeted request of the step, so the
    scheduler can reconcile even after a lost report (it frees the dead blocks it has not freed
    yet). ``applied``: the requests whose order of this step every attention layer applied.
    """

    applied: tuple[str, ...]
    seconds: float
    states: dict[str, RowState] = field(default_factory=dict)
    failures: tuple[RowFailure, ...] = ()


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
) -> int:
    """The most KV blocks a request can hold at once, over its whole life (worst case).

    The KV of ``prompt_len + max_tokens - 1`` tokens is computed at most (the last token's is
    never needed). ``budget=None``: a stock request, all of it. With a budget, the prompt is
    held whole until the prefill eviction, unless ``prefill_evict``: then a prefill step holds
    the kept tokens (< budget + bs) plus one chunk of at most ``chunk`` tokens. After the
    prompt, the kept tokens (< budget + bs) grow by the generated ones, or stay under
    budget + bs (+ one block of alignment) with ``decode``.
    """
    bs = block_size
    total = prompt_len + max(max_tokens, 1) - 1
    if budget is None or budget >= prompt_len and not decode:
        return _cdiv(total, bs)
    prompt_blocks = _cdiv(prompt_len, bs)
    if prefill_evict:
        prompt_blocks = min(prompt_blocks, _cdiv(budget + bs - 1 + chunk, bs))
    kept = min(prompt_len, budget + bs - 1)
    generated = max(max_tokens, 1) - 1
    if decode:
        after = min(_cdiv(kept + generated, bs), _cdiv(budget + bs, bs) + 1)
    else:
        after = _cdiv(kept + generated, bs)
    return max(prompt_blocks, after)
