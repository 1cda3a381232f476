"""Which resident entries survive: top scores per KV head, plus sinks and a recent window.

Glossary: Hkv KV heads, T resident entries, K kept entries per head, S sinks, R recent window.

    resident index  0 .. S-1 | S ............. T-R-1 | T-R .. T-1
                    sinks    | ranked by score:       | recent
                    (kept)   | top K-S-R kept         | (kept)

Every head keeps exactly K entries; heads may keep different ones. Ties go to the lower index.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def _check_count(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return value


def select_keep(scores: Tensor, keep: int, recent: int = 0, sinks: int = 0) -> Tensor:
    """Sorted resident indices to keep, LongTensor [Hkv, K], from scores [Hkv, T].

    Keeps the first ``sinks`` and last ``recent`` entries and the ``keep - sinks - recent``
    highest-scored entries between them (NaN scores rank lowest). Each row is sorted ascending
    and unique. Batched over heads: one partial top-k and a few masks, no sort, no loop.
    """
    if scores.dim() != 2:
        raise ValueError(f"scores must be [Hkv, T], got {tuple(scores.shape)}")
    keep, recent, sinks = (
        _check_count(n, x) for n, x in (("keep", keep), ("recent", recent), ("sinks", sinks))
    )
    num_heads, num_t = scores.shape
    if keep > num_t:
        raise ValueError(f"cannot keep {keep} of {num_t} entries")
    if sinks + recent > keep:
        raise ValueError(f"sinks ({sinks}) + recent ({recent}) exceed the kept count ({keep})")

    device = scores.device
    if keep == num_t:
        return torch.arange(num_t, device=device).expand(num_heads, num_t).clone()  # [Hkv, T]
    ranked = _top_in_order(scores[:, sinks : num_t - recent], keep - sinks - recent) + sinks
    fixed_sinks = torch.arange(sinks, device=device).expand(num_heads, sinks)  # [Hkv, S]
    fixed_recent = torch.arange(num_t - recent, num_t, device=device).expand(num_heads, recent)
    return torch.cat([fixed_sinks, ranked, fixed_recent], dim=1)  # [Hkv, K]


def _top_in_order(middle: Tensor, count: int) -> Tensor:
    """Indices of the ``count`` best entries of each row of middle [Hkv, M], ascending.

    No full sort: the count-th best value is the row's threshold; everything above it is kept,
    and the ties AT the threshold are filled from the lowest index up (cumsum). Exactly ``count``
    per row, so nonzero() lists them row by row, each row ascending.
    """
    num_heads, width = middle.shape
    if count == 0:
        return torch.zeros((num_heads, 0), dtype=torch.int64, device=middle.device)
    if middle.is_floating_point():
        middle = middle.nan_to_num(nan=float("-inf"))  # NaN ranks lowest
    threshold = torch.topk(middle, count, dim=1, sorted=False).values.amin(dim=1, keepdim=True)
    above = middle > threshold  # [Hkv, M]
    at = middle == threshold  # [Hkv, M]
    room = count - above.sum(dim=1, keepdim=True)  # [Hkv, 1] ties still to keep
    chosen = above | (at & (at.cumsum(dim=1) <= room))  # [Hkv, M], count per row
    return chosen.nonzero()[:, 1].view(num_heads, count)  # [Hkv, count]


def share_across_heads(
    scores: Tensor, reduce: Callable[[Tensor], Tensor] | None = None
) -> Tensor:
    """One ranking for the whole layer: the scores summed over KV heads, [Hkv, T] -> [Hkv, T].

    The OBCache objective is a sum of output errors over heads, so the layer-level score of an
    entry is the sum of its per-head scores; every head then keeps the same entries.
    ``reduce`` sums the local [1, T] sum over the other holders of this layer's heads (tensor
    parallelism: an all-reduce over the TP group), so every rank ranks by all the heads.
    """
    summed = scores.sum(dim=0, keepdim=True)  # [1, T] over this rank's heads
    if reduce is not None:
        summed = reduce(summed)  # [1, T] over every rank's heads
    return summed.expand_as(scores)  # [Hkv, T]
