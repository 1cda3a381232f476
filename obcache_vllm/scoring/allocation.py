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
    priority = scores.to(torch.float64).nan_to_num(nan=float("-inf"))
    fixed = torch.zeros(num_t, dtype=torch.bool, device=scores.device)
    fixed[:sinks] = True
    if recent:
        fixed[num_t - recent :] = True
    priority = priority.masked_fill(fixed, float("inf"))
    floor = max(int(alpha * keep), sinks + recent)  # int(): as kvpress rounds it
    # Each head's own best ``floor`` (the fixed entries first).
    order = torch.sort(priority, dim=1, descending=True, stable=True).indices  # [Hkv, T]
    kept = torch.zeros((heads, num_t), dtype=torch.bool, device=scores.device)
    kept.scatter_(1, order[:, :floor], True)
    # The rest of the layer's total: the best remaining entries across heads.
    rest = keep * heads - floor * heads
    if rest > 0:
        flat = priority.masked_fill(kept, float("-inf")).reshape(-1)  # head-major
        chosen = torch.sort(flat, descending=True, stable=True).indices[:rest]
        kept.view(-1)[chosen] = True
    return kept
