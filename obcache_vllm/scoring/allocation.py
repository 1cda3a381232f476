"""Adaptive budget allocation across KV heads (AdaKV), on plain tensors.

AdaKV (Feng et al., "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation") keeps
the same total per layer as a uniform selection, ``keep * Hkv`` entries, but spreads it over the
layer's KV heads by their scores: the layer's entries are ranked together, across heads, so a
head whose scores are concentrated gives up entries to one whose scores are spread out. A
safeguard first keeps each head's own best ``int(alpha * keep)`` entries (kvpress's
``AdaKVPress`` with ``alpha_safeguard``, 0.20, whose selection this follows; AdaKV's own code
shrinks the counts of a layer-wide top-k towards the floor instead, with ``floor_alpha`` 0.2).

Scores of different heads are compared directly, so they must be on one scale per layer: the
attention-based scores are (each is a sum over the same window rows of a per-row quantity), and
the query-free ones are not meant for this.

Glossary: Hkv KV heads, T resident entries, K kept per head on average (the uniform budget).
"""

from __future__ import annotations

import torch
from torch import Tensor

ALPHA = 0.20


def _ranked(scores: Tensor, sinks: int, recent: int,
            lengths: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """(priority [Hkv, T], each head's entries best first [Hkv, T], valid [Hkv, T]): the first
    ``sinks`` and last ``recent`` entries of each head rank above every score, NaN below (ties
    to the lower index). ``lengths`` [Hkv]: head h's entries are its first ``lengths[h]``
    columns (None: all T); the columns past it rank after every entry of the head."""
    heads, num_t = scores.shape
    index = torch.arange(num_t, device=scores.device)
    if lengths is None:
        lengths = torch.full((heads,), num_t, dtype=torch.int64, device=scores.device)
    ends = lengths.to(device=scores.device, dtype=torch.int64).view(heads, 1)
    valid = index < ends  # [Hkv, T]
    fixed = (index < sinks) | ((index >= ends - recent) & valid) if recent else index < sinks
    priority = scores.to(torch.float64).nan_to_num(nan=float("-inf"))
    priority = priority.masked_fill(fixed & valid, float("inf"))
    order = torch.sort(priority, dim=1, descending=True, stable=True).indices
    if not bool(valid.all()):  # stable: the valid entries first, in the same order
        invalid_last = (~valid).gather(1, order).to(torch.int8)
        order = order.gather(1, torch.sort(invalid_last, dim=1, stable=True).indices)
    return priority, order, valid


def _check_lengths(lengths: Tensor | None, heads: int, num_t: int) -> Tensor | None:
    if lengths is None:
        return None
    lengths = torch.as_tensor(lengths, dtype=torch.int64)
    if lengths.shape != (heads,) or bool((lengths < 0).any()) or bool((lengths > num_t).any()):
        raise ValueError(f"lengths must be [{heads}] within [0, {num_t}], got {lengths.tolist()}")
    return lengths


def adaptive_keep(scores: Tensor, keep: int, *, recent: int = 0, sinks: int = 0,
                  alpha: float = ALPHA, lengths: Tensor | None = None) -> Tensor:  # fmt: skip
    """The kept entries of one layer as a mask [Hkv, T]: ``keep * Hkv`` of them in all.

    Every head keeps its first ``sinks`` and last ``recent`` entries and at least
    ``max(int(alpha * keep), sinks + recent)`` entries: its own best ones; the rest of the
    layer's total goes to the best remaining entries of any head (ties to the lower head, then
    the lower index; NaN ranks lowest). ``keep`` at most T.

    ``lengths`` [Hkv]: heads that hold different numbers of entries (a per-head layout that
    decode has grown): head h's are its first ``lengths[h]`` columns, the rest is padding that
    is never kept; a head shorter than the floor keeps all of its entries. ``keep * Hkv`` at
    most their sum. Equal lengths select exactly as None does.
    """
    if scores.dim() != 2:
        raise ValueError(f"scores must be [Hkv, T], got {tuple(scores.shape)}")
    heads, num_t = scores.shape
    lengths = _check_lengths(lengths, heads, num_t)
    room = num_t * heads if lengths is None else int(lengths.sum())
    if not 0 <= keep * heads <= room or keep > num_t:
        raise ValueError(f"cannot keep {keep} of {num_t} entries per head ({room} in all)")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must lie in [0, 1], got {alpha}")
    if sinks + recent > keep:
        raise ValueError(f"sinks ({sinks}) + recent ({recent}) exceed the kept count ({keep})")
    priority, order, valid = _ranked(scores, sinks, recent, lengths)
    floor = max(int(alpha * keep), sinks + recent)  # int(): as kvpress rounds it
    floors = valid.sum(dim=1).clamp(max=floor)  # [Hkv]: a head keeps at most what it holds
    # Each head's own best ``floor`` (the fixed entries first).
    rank = torch.arange(num_t, device=scores.device).view(1, num_t)
    kept = torch.zeros((heads, num_t), dtype=torch.bool, device=scores.device)
    kept.scatter_(1, order, rank < floors.view(heads, 1))
    # The rest of the layer's total: the best remaining entries across heads.
    rest = keep * heads - int(floors.sum())
    if rest > 0:
        free = (valid & ~kept).view(-1).nonzero().squeeze(1)  # head-major, ascending
        best = torch.sort(priority.view(-1)[free], descending=True, stable=True).indices
        kept.view(-1)[free[best[:rest]]] = True
    return kept


def adaptive_head_blocks(scores: Tensor, *, tail: int, body_blocks: int, block_size: int,
                         recent: int = 0, sinks: int = 0, alpha: float = ALPHA,
                         lengths: Tensor | None = None) -> list[Tensor]:  # fmt: skip
    """AdaKV's allocation in whole head-blocks: the kept entries of each KV head of one layer.

    The layout this serves (per-head memory, see ``docs/contributing/per_head_memory.md``): the
    last ``tail`` resident entries stay where they are in every head (the block new tokens are
    written to), and ``body_blocks * Hkv`` head-blocks of ``block_size`` entries are shared out
    among the heads for the rest. Head ``h`` keeps ``m_h * block_size`` of the first
    ``T - tail`` entries plus the tail, with ``sum(m_h) = body_blocks * Hkv``: the layer keeps
    as many entries as a uniform selection of ``body_blocks * block_size + tail`` per head, and
    its memory follows the sum of the heads' counts.

    The counts come from :func:`adaptive_keep` over the first ``T - tail`` entries (the
    safeguard, then the layer's best across heads), rounded to whole head-blocks by the
    largest remainders (ties to the lower head), never below what a head's sinks and recent
    entries need; each head then keeps its own best ``m_h * block_size`` (sinks and recent
    entries first). Returns one sorted LongTensor of kept indices per head.

    ``lengths`` [Hkv]: heads that already hold different numbers of entries (a per-head layout
    evicted again at decode): head h's entries are its first ``lengths[h]`` columns, of which
    the last ``tail`` are the tail; each head's body ``lengths[h] - tail`` is whole blocks, and
    no head is given more head-blocks than its body holds. None: every head holds T.
    """
    if scores.dim() != 2:
        raise ValueError(f"scores must be [Hkv, T], got {tuple(scores.shape)}")
    heads, num_t = scores.shape
    bs = block_size
    given = _check_lengths(lengths, heads, num_t)
    sizes = [num_t] * heads if given is None else given.tolist()
    body_ts = [n - tail for n in sizes]
    if not 1 <= tail <= min(sizes) or any(b % bs for b in body_ts):
        raise ValueError(f"tail {tail} must leave whole blocks of {bs} of {sizes} entries")
    if not 0 <= body_blocks * bs * heads <= sum(body_ts):
        raise ValueError(f"cannot keep {body_blocks} blocks of {bs} in {body_ts} entries")
    recent_body = max(0, recent - tail)
    fixed = sinks + recent_body
    if fixed > body_blocks * bs:
        raise ValueError(f"sinks ({sinks}) + recent ({recent}) exceed the kept count")
    tails = [torch.arange(b, n, device=scores.device) for b, n in zip(body_ts, sizes, strict=True)]
    if body_blocks == 0:
        return tails
    width = max(body_ts)
    body = scores[:, :width]
    body_lengths = None if given is None else torch.tensor(body_ts, dtype=torch.int64)
    counts = adaptive_keep(body, body_blocks * bs, recent=recent_body, sinks=sinks,
                           alpha=alpha, lengths=body_lengths).sum(dim=1).tolist()  # fmt: skip
    least = -(-fixed // bs)
    room = [b // bs for b in body_ts]
    if any(least > r for r in room):
        raise ValueError(f"a head's body {body_ts} cannot hold its sinks and recent entries")
    blocks = [max(c // bs, least) for c in counts]
    spare = body_blocks * heads - sum(blocks)
    by_remainder = sorted(range(heads), key=lambda h: (-(counts[h] % bs), h))
    while spare > 0:  # the largest remainders get the blocks left
        grew = False
        for h in by_remainder:
            if spare and blocks[h] < room[h]:
                blocks[h] += 1
                spare -= 1
                grew = True
        if not grew:
            raise ValueError("no head has room for the blocks left")  # cannot happen: sum fits
    while spare < 0:  # the floor took more than the total: the smallest remainders give back
        for h in reversed(by_remainder):
            if spare and blocks[h] > least:
                blocks[h] -= 1
                spare += 1
    order = _ranked(body, sinks, recent_body, body_lengths)[1]  # [Hkv, width]
    return [torch.cat([order[h, : blocks[h] * bs].sort().values, tails[h]])
            for h in range(heads)]  # fmt: skip
