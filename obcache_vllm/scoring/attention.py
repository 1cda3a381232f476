"""Attention of a few window queries over the resident keys, batched over KV groups.

Every attention-based score is a sum over query rows of a per-(row, position) term built from the
probabilities ``A``, the scaled logits ``Z`` and the outputs ``O = A V`` of the window queries. This
module computes those for all heads at once, a chunk of queries at a time, never a [W, T, D] tensor.

Glossary (shape comments):
  W    window queries (the last W positions at prefill, 1 per decode step); Wc per chunk
  T    resident KV entries of the layer
  Hq   query heads, Hkv KV heads, G = Hq // Hkv query heads per KV head
  D    head dim (Dv for values); R = G * Wc query rows per KV head, row r = g * Wc + i

Positions: ``q_pos`` [W] and ``k_pos`` [T] (or [Hkv, T] when heads hold different tokens) are
LOGICAL token positions; key p is visible to query i iff ``k_pos[p] <= q_pos[i]``.

Layout: k, v are [T, Hkv, D] but are read per head as contiguous [Hkv, T, D]. Pass a
``transpose(0, 1)`` view of a contiguous fp32 [Hkv, T, D] tensor to avoid a copy per call.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from obcache_vllm.scoring.geometry import HeadGeometry

# Largest [Hkv, R, T] temporary, in elements (8 MiB in fp32): keeps the working set near the
# caches and below glibc's 32 MiB mmap threshold, past which every allocation page-faults afresh.
CHUNK_ELEMENTS = 1 << 21
# On an accelerator a chunk is one set of kernel launches: fewer, larger ones (256 MiB per fp32
# temporary, a few alive at once: inside the headroom vLLM leaves outside its KV pool). Measured
# on an H200 (results/gpu/, W = 64, Hq 32, Hkv 8, D 128, T = 32K): the key score took 50 ms with
# the CPU chunk (3.6x an SDPA prefill of the same tokens), 8.2 ms with 16Mi, 4.0 ms with 64Mi.
DEVICE_CHUNK_ELEMENTS = 1 << 26


def chunk_budget(device: torch.device, override: int | None = None) -> int:
    """Elements of the largest scoring temporary on ``device`` (``override`` wins)."""
    if override is not None:
        return override
    return CHUNK_ELEMENTS if device.type == "cpu" else DEVICE_CHUNK_ELEMENTS


def compute_dtype(*tensors: Tensor) -> torch.dtype:
    """fp64 when any input is fp64 (exactness tests), else fp32 (bf16/fp16 caches included)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def check_shapes(q: Tensor | None, k: Tensor, v: Tensor, geom: HeadGeometry) -> None:
    """Raise ValueError unless q [W, Hq, D], k [T, Hkv, D], v [T, Hkv, Dv] match ``geom``."""
    if k.dim() != 3 or k.shape[1:] != (geom.num_kv_heads, geom.head_dim):
        raise ValueError(
            f"k must be [T, {geom.num_kv_heads}, {geom.head_dim}], got {tuple(k.shape)}"
        )
    if v.dim() != 3 or v.shape[:2] != k.shape[:2]:
        raise ValueError(f"v must be [{k.shape[0]}, {geom.num_kv_heads}, Dv], got {tuple(v.shape)}")
    if q is not None and (q.dim() != 3 or q.shape[1:] != (geom.num_q_heads, geom.head_dim)):
        raise ValueError(
            f"q must be [W, {geom.num_q_heads}, {geom.head_dim}], got {tuple(q.shape)}"
        )


def resolve_positions(
    num_queries: int,
    num_keys: int,
    q_pos: Tensor | None,
    k_pos: Tensor | None,
    device: torch.device,
) -> tuple[Tensor, Tensor]:
    """Logical positions, defaulting to queries = the last W of a contiguous T-long sequence.

    Returns q_pos [W] and k_pos [T] or [Hkv, T] as int64 tensors on ``device``.
    """
    if q_pos is None:
        if k_pos is not None:
            raise ValueError("q_pos is required when k_pos is given")
        if num_queries > num_keys:
            raise ValueError(
                f"{num_queries} window queries cannot be the last positions of {num_keys} keys; "
                "pass q_pos/k_pos"
            )
        q_pos = torch.arange(num_keys - num_queries, num_keys, device=device)
    if k_pos is None:
        k_pos = torch.arange(num_keys, device=device)
    q_pos = q_pos.to(device=device, dtype=torch.int64)
    k_pos = k_pos.to(device=device, dtype=torch.int64)
    if q_pos.shape != (num_queries,):
        raise ValueError(f"q_pos must be [{num_queries}], got {tuple(q_pos.shape)}")
    if k_pos.shape[-1:] != (num_keys,) or k_pos.dim() > 2:
        raise ValueError(
            f"k_pos must be [{num_keys}] or [Hkv, {num_keys}], got {tuple(k_pos.shape)}"
        )
    return q_pos, k_pos


def heads_first(x: Tensor, dtype: torch.dtype) -> Tensor:
    """[T, Hkv, D] -> [Hkv, T, D] in ``dtype``, each head's [T, D] block row-contiguous.

    No copy when x already is such a view (e.g. ``transpose(0, 1)`` of a contiguous or
    T-sliced [Hkv, T, D] tensor). Batched products over the head-interleaved [T, Hkv, D]
    layout are several times slower on CPU when few queries are scored (decode), so that layout
    is copied once per call.
    """
    if x.dtype != dtype:
        x = x.to(dtype)  # same layout first: converting while transposing is slower
    heads_first = x.transpose(0, 1)  # [Hkv, T, D]
    if heads_first.stride(-1) == 1 and heads_first.stride(-2) == heads_first.shape[-1]:
        return heads_first
    return heads_first.contiguous()


@dataclass
class Resident:
    """The resident keys and values of one layer, per KV head, with per-position statistics.

    Values are laid out on first use only: the attention-mass score never reads them.
    """

    keys: Tensor  # [Hkv, T, D]
    k_pos: Tensor  # [T] or [Hkv, T] logical positions
    raw_values: Tensor  # [T, Hkv, Dv] as given

    @classmethod
    def from_kv(cls, k: Tensor, v: Tensor, k_pos: Tensor, dtype: torch.dtype) -> Resident:
        return cls(keys=heads_first(k, dtype), k_pos=k_pos, raw_values=v)

    @cached_property
    def values(self) -> Tensor:
        """V [Hkv, T, Dv] in the compute dtype."""
        return heads_first(self.raw_values, self.keys.dtype)

    @cached_property
    def value_sq(self) -> Tensor:
        """|v_p|^2 [Hkv, T]."""
        return torch.linalg.vector_norm(self.values, dim=-1).square_()

    @cached_property
    def value_l1(self) -> Tensor:
        """|v_p|_1 [Hkv, T] (abs + sum: vector_norm(ord=1) has no fast CPU kernel)."""
        return self.values.abs().sum(dim=-1)


@dataclass
class WindowAttention:
    """``A`` and ``Z`` of one chunk of window queries, rows grouped per KV head.

    probs:  A [Hkv, R, T], 0 where masked; a query that sees no key has an all-0 row.
    logits: Z [Hkv, R, T], scaled ``q . k``, 0 where masked (so A * Z never meets -inf);
            None when not requested (the softmax then overwrote them in place).
    Scorers consume it: they may overwrite probs and logits in place.
    """

    probs: Tensor
    logits: Tensor | None
    resident: Resident

    def outputs(self) -> Tensor:
        """O = A V [Hkv, R, Dv]."""
        return torch.bmm(self.probs, self.resident.values)  # [Hkv, R, Dv]


def queries_per_chunk(geom: HeadGeometry, num_keys: int, budget: int = CHUNK_ELEMENTS) -> int:
    """Wc: how many queries fit one [Hkv, G * Wc, T] temporary of ``budget`` elements."""
    return max(1, budget // max(1, geom.num_q_heads * num_keys))


def attend(
    q: Tensor,
    res: Resident,
    geom: HeadGeometry,
    q_pos: Tensor,
    *,
    keep_logits: bool,
) -> WindowAttention:
    """Masked softmax attention of q [Wc, Hq, D] (positions q_pos [Wc]) over ``res``."""
    num_w, num_t = q.shape[0], res.keys.shape[1]
    h_kv, group, dim = geom.num_kv_heads, geom.group, geom.head_dim
    k_pos = res.k_pos

    # Pre-scaling q is cheaper than scaling the [Hkv, R, T] logits.
    q_rows = (q.to(res.keys.dtype) * geom.scale).view(num_w, h_kv, group, dim)  # [Wc, Hkv, G, D]
    q_rows = q_rows.permute(1, 2, 0, 3).reshape(h_kv, group * num_w, dim)  # [Hkv, R, D]
    logits = torch.bmm(q_rows, res.keys.transpose(1, 2))  # [Hkv, R, T]

    # Only columns from the first one hidden from some query need the mask (at prefill with the
    # default positions: the last Wc - 1 columns), so the mask stays small.
    q_min = q_pos.min()
    hidden_cols = (k_pos > q_min).reshape(-1, num_t).any(0)  # [T]
    first_hidden = int(hidden_cols.int().argmax()) if bool(hidden_cols.any()) else num_t
    tail_mask = tail = None
    blind_rows = False
    if first_hidden < num_t:
        hidden = k_pos[..., None, first_hidden:] > q_pos[:, None]  # [(Hkv,) Wc, T']
        tail_mask = hidden.unsqueeze(-3)  # [(Hkv,) 1, Wc, T'] against [Hkv, G, Wc, T']
        tail = logits.view(h_kv, group, num_w, num_t)[..., first_hidden:]  # [Hkv, G, Wc, T']
        tail.masked_fill_(tail_mask, float("-inf"))
        blind_rows = bool((k_pos.min(-1).values > q_min).any())

    if keep_logits:
        probs = torch.softmax(logits, dim=-1)  # [Hkv, R, T]
    else:
        probs = torch.softmax(logits, dim=-1, out=logits)  # [Hkv, R, T], in place
        logits = None
    if blind_rows:  # a query that sees no key: softmax gave NaN, its row contributes nothing
        probs.nan_to_num_(0.0)
    if logits is not None and tail is not None:
        tail.masked_fill_(tail_mask, 0.0)  # Z = 0 where A = 0
    return WindowAttention(probs=probs, logits=logits, resident=res)
