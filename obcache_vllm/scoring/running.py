"""Decode-time running scores of one request in one layer, per KV head and resident entry.

Each decode step scores the resident entries with the new query (W = 1) and hands the result to
``add``; ``mode="sum"`` accumulates (H2O: the sum over every query seen so far), ``mode="last"``
replaces (TOVA: the newest query only). Entries appended since the previous step get the missing
columns, starting from 0. After an eviction, ``gather(keep)`` keeps the same columns as the cache,
so column j always describes resident entry j.

Glossary: Hkv KV heads, T resident entries, K kept per head.

Lifecycle: created when the request is added, ``reset`` on preemption, dropped on finish/abort.
Storage grows by doubling, so a decode step costs O(T) and no reallocation per token.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor


class RunningScores:
    """Per-(request, layer) running scores [Hkv, T]."""

    def __init__(
        self,
        num_kv_heads: int,
        mode: Literal["sum", "last"] = "sum",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if num_kv_heads < 1:
            raise ValueError(f"num_kv_heads must be >= 1, got {num_kv_heads}")
        if mode not in ("sum", "last"):
            raise ValueError(f"mode must be 'sum' or 'last', got {mode!r}")
        self.num_kv_heads = num_kv_heads
        self.mode = mode
        self.dtype = dtype
        self._buf: Tensor | None = None  # [Hkv, capacity]; columns >= length are 0
        self._length = 0

    @property
    def length(self) -> int:
        """T: resident entries covered by the scores."""
        return self._length

    @property
    def scores(self) -> Tensor:
        """The running scores [Hkv, T] (a view: clone it to keep it across ``add``/``gather``)."""
        if self._buf is None:
            return torch.zeros((self.num_kv_heads, 0), dtype=self.dtype)
        return self._buf[:, : self._length]

    def add(self, step_scores: Tensor) -> None:
        """Fold in one step's scores [Hkv, T_now] for the current residents, T_now >= length."""
        if step_scores.dim() != 2 or step_scores.shape[0] != self.num_kv_heads:
            raise ValueError(
                f"step scores must be [{self.num_kv_heads}, T], got {tuple(step_scores.shape)}"
            )
        num_t = step_scores.shape[1]
        if num_t < self._length:
            raise ValueError(
                f"step scores cover {num_t} entries, fewer than the {self._length} resident"
            )
        self._reserve(num_t, step_scores.device)
        target = self._buf[:, :num_t]  # [Hkv, T_now]
        if self.mode == "sum":
            target.add_(step_scores)
        else:
            target.copy_(step_scores)
        self._length = num_t

    def gather(self, keep: Tensor) -> None:
        """Keep only the columns ``keep`` [Hkv, K] (the cache's new resident order)."""
        if keep.dim() != 2 or keep.shape[0] != self.num_kv_heads:
            raise ValueError(f"keep must be [{self.num_kv_heads}, K], got {tuple(keep.shape)}")
        num_keep = keep.shape[1]
        if num_keep > self._length:
            raise ValueError(f"cannot keep {num_keep} of {self._length} resident entries")
        if self._buf is None:
            return
        kept = self._buf[:, : self._length].gather(1, keep.to(self._buf.device))  # [Hkv, K]
        self._buf[:, :num_keep] = kept
        self._buf[:, num_keep : self._length] = 0
        self._length = num_keep

    def reset(self) -> None:
        """Forget everything (preemption: the request will be prefilled again)."""
        self._buf = None
        self._length = 0

    def _reserve(self, num_t: int, device: torch.device) -> None:
        if self._buf is not None and self._buf.shape[1] >= num_t:
            return
        capacity = max(num_t, 2 * (0 if self._buf is None else self._buf.shape[1]), 16)
        buf = torch.zeros((self.num_kv_heads, capacity), dtype=self.dtype, device=device)
        if self._buf is not None:
            buf[:, : self._length] = self._buf[:, : self._length]
        self._buf = buf

    def __repr__(self) -> str:
        return (
            f"RunningScores(num_kv_heads={self.num_kv_heads}, mode={self.mode!r}, "
            f"length={self._length})"
        )
