"""The head geometry of one attention layer: the only model facts the scoring math needs."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class HeadGeometry:
    """Query/KV head counts and head size of one layer (GQA when ``num_q_heads > num_kv_heads``).

    Query head ``h`` reads KV head ``h // group`` (the layout of vLLM and of HF ``repeat_kv``).
    ``scale`` multiplies the logits ``q . k``; it defaults to ``head_dim ** -0.5`` and is always a
    float after construction.
    """

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float | None = None

    def __post_init__(self) -> None:
        for field in ("num_q_heads", "num_kv_heads", "head_dim"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"HeadGeometry.{field} must be a positive int, got {value!r}")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"num_q_heads={self.num_q_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )
        scale = self.head_dim**-0.5 if self.scale is None else float(self.scale)
        if not math.isfinite(scale) or scale <= 0.0:
            raise ValueError(f"HeadGeometry.scale must be a positive finite float, got {scale!r}")
        object.__setattr__(self, "scale", scale)

    @property
    def group(self) -> int:
        """G: query heads per KV head."""
        return self.num_q_heads // self.num_kv_heads
