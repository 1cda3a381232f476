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


def _ranked(scores: Tensor, sinks: int, recent: int) -> tuple[Tensor, Tensor]:
    """(priority [Hkv, T], each head's entries best first [Hkv, T]): the first ``sinks`` and
    last ``recent`` entries rank above every score, NaN below (ties to the lower index)."""
    num_t = scores.shape[1]
    priority = scores.to(torch.float64).nan_to_num(nan=float("-inf"))
    fixed = torch.zeros(num_t, dtype=torch.bool, device=scores.device)
    fixed[:sinks] = True
    if recent:
        fixed[num_t - recent :] = True
    priority = priority.masked_fill(fixed, float("inf"))
    return priority, torch.sort(priority, dim=1, descending=True, stable=True).indices


def adaptive_keep(scores: Tensor, keep: int, *, recent: int = 0, sinks: int = 0,
                  alpha: float = ALPHA) -> Tensor:  # fmt: skip
    """The kept entries of one layer as a mask [Hkv, T]: ``keep * Hkv`` of them in all.

    Every head keeps its first ``sinks`` and last ``recent`` entries and at least
    ``max(int(alpha * keep), sinks + recent)`` entries: its own best ones; the rest of the
    layer's total goes to the best remaining entries of any head (ties to the lower head, then
    the lower index; NaN ranks lowest). ``keep`` at most T.
    """
    if scores.dim() != 2:
        raise ValueError(f"scores must be [Hkv, T], got {tuple(scores.shape)}")
    heads, num_t = scores.shape
    if not 0 <= keep <= num_t:
        raise ValueError(f"cannot keep {keep} of {num_t} entries")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must lie in [0, 1], got {alpha}")
    if sinks + recent > keep:
        raise ValueError(f"sinks ({sinks}) + recent ({recent}) exceed the kept count ({keep})")
    priority, order = _ranked(scores, sinks, recent)
    floor = max(int(alpha * keep), sinks + recent)  # int(): as kvpress rounds it
    # Each head's own best ``floor`` (the fixed entries first).
    kept = torch.zeros((heads, num_t), dtype=torch.bool, device=scores.device)
    kept.scatter_(1, order[:, :floor], True)
    # The rest of the layer's total: the best remaining entries across heads.
    rest = keep * heads - floor * heads
    if rest > 0:
        flat = priority.masked_fill(kept, float("-inf")).reshape(-1)  # head-major
        chosen = torch.sort(flat, descending=True, stable=True).indices[:rest]
        kept.view(-1)[chosen] = True
    return kept


def adaptive_head_blocks(scores: Tensor, *, tail: int, body_blocks: int, block_size: int,
                         recent: int = 0, sinks: int = 0, alpha: float = ALPHA
                         ) -> list[Tensor]:  # fmt: skip
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
    """
    if scores.dim() != 2:
        raise ValueError(f"scores must be [Hkv, T], got {tuple(scores.shape)}")
    heads, num_t = scores.shape
    bs = block_size
    body_t = num_t - tail
    if not 1 <= tail <= num_t or body_t % bs:
        raise ValueError(f"tail {tail} must leave whole blocks of {bs} of {num_t} entries")
    if not 0 <= body_blocks * bs <= body_t:
        raise ValueError(f"cannot keep {body_blocks} blocks of {bs} in {body_t} entries")
    recent_body = max(0, recent - tail)
    fixed = sinks + recent_body
    if fixed > body_blocks * bs:
        raise ValueError(f"sinks ({sinks}) + recent ({recent}) exceed the kept count")
    tail_index = torch.arange(body_t, num_t, device=scores.device)
    if body_blocks == 0:
        return [tail_index.clone() for _ in range(heads)]
    body = scores[:, :body_t]
    counts = adaptive_keep(body, body_blocks * bs, recent=recent_body, sinks=sinks,
                           alpha=alpha).sum(dim=1).tolist()  # fmt: skip
    least = -(-fixed // bs)
    blocks = [max(c // bs, least) for c in counts]
    spare = body_blocks * heads - sum(blocks)
    by_remainder = sorted(range(heads), key=lambda h: (-(counts[h] % bs), h))
    while spare > 0:  # the largest remainders get the blocks left
        grew = False
        for h in by_remainder:
            if spare and blocks[h] * bs < body_t:
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
    order = _ranked(body, sinks, recent_body)[1]  # [Hkv, body_t]
    return [torch.cat([order[h, : blocks[h] * bs].sort().values, tail_index])
            for h in range(heads)]  # fmt: skip
