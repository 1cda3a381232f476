"""Token scores for one layer: one small class per score, behind ``make_scorer(name)``.

Every scorer maps the window queries q [W, Hq, D] and the resident keys/values k, v [T, Hkv, D]
to a score [Hkv, T] per KV head and resident entry; higher = more important = keep. Attention-based
scores are sums over the window rows and over the G query heads of the KV group (the GQA objective
sums the output error of the group's query heads). Computed in fp32 whatever the input dtype, or in
fp64 when any input is fp64 (then the result is fp64 too, for the exactness tests).

Glossary: W window queries, T resident KV entries, Hq/Hkv heads, G = Hq // Hkv, D head dim,
R = G * W query rows per KV head. A = softmax(Z) the causal attention probabilities, Z = q.k * scale
the logits, O = A V the window outputs, all per KV head as [Hkv, R, T] / [Hkv, R, D].

OBCache (arXiv 2510.07651), with Y = A * Z and the identity |v - o|^2 = |v|^2 - 2 v.o + |o|^2
(no [W, T, D] temporary: v.o comes from one [R, D] x [D, T] product per KV head):
  obcache_value  S[p] = sum_r A^2 |v_p|^2
  obcache_key    S[p] = sum_r Y^2 |v_p - o_r|^2
  obcache_joint  S[p] = sum_r |(A + Y) v_p - Y o_r|^2          (= value + key + cross term)

The closest published rival, DropKV (kvpress PR #285, written here from its formula): evicting
p alone renormalises the softmax over the rest, and o_r changes by exactly
A/(1 - A) (o_r - v_p), so
  dropkv         S[p] = sum_r (A / (1 - A))^2 |v_p - o_r|^2     (exact, one token at a time)
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from obcache_vllm.scoring.attention import (
    Resident,
    WindowAttention,
    attend,
    check_shapes,
    chunk_budget,
    compute_dtype,
    queries_per_chunk,
    resolve_positions,
)
from obcache_vllm.scoring.geometry import HeadGeometry


class Scorer:
    """Base class: ``scorer(q, k, v, geom, q_pos=None, k_pos=None) -> [Hkv, T]``.

    Attention-based subclasses implement ``from_attention`` (one chunk of queries; the chunk
    results are summed); the query-free ones override ``__call__``. ``chunk_elements`` bounds the
    [Hkv, G * Wc, T] temporaries (an instance may override it).
    """

    name: ClassVar[str]
    needs_attention: ClassVar[bool] = True
    # Whether from_attention reads the logits Z (else softmax may overwrite them in place).
    needs_logits: ClassVar[bool] = False
    chunk_elements: int | None = None  # None: chunk_budget's default for the tensors' device
    # Whether the score is a share of the attention the queries give each token, so that a
    # sum of evicted scores over the total is the share of attention lost: what a budget by
    # error target reads where no window of queries is kept (h2o; see scoring/estimate.py).
    attention_share: ClassVar[bool] = False

    def __call__(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        geom: HeadGeometry,
        q_pos: Tensor | None = None,
        k_pos: Tensor | None = None,
    ) -> Tensor:
        check_shapes(q, k, v, geom)
        num_w, num_t = q.shape[0], k.shape[0]
        dtype = compute_dtype(q, k, v)
        if num_w == 0 or num_t == 0:  # no query or no key: nothing to measure
            return k.new_zeros((geom.num_kv_heads, num_t), dtype=dtype)
        q_pos, k_pos = resolve_positions(num_w, num_t, q_pos, k_pos, k.device)
        res = Resident.from_kv(k, v, k_pos, dtype)
        step = queries_per_chunk(geom, num_t, chunk_budget(k.device, self.chunk_elements))
        total = None
        for start in range(0, num_w, step):
            att = attend(
                q[start : start + step],
                res,
                geom,
                q_pos[start : start + step],
                keep_logits=self.needs_logits,
            )
            part = self.from_attention(att)  # [Hkv, T]
            total = part if total is None else total.add_(part)
        return total

    def from_attention(self, att: WindowAttention) -> Tensor:
        """The score summed over the chunk's rows, [Hkv, T]."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class AttentionMass(Scorer):
    """sum_r A[r, p]: the score of H2O, TOVA and SnapKV."""

    name = "attn"
    attention_share = True

    def from_attention(self, att: WindowAttention) -> Tensor:
        return _sum_rows(att.probs)  # [Hkv, T]


class ValueNorm(Scorer):
    """sum_r A[r, p] * |v_p|_1: attention scaled by the value's l1 norm (VATP / CriticalKV)."""

    name = "value_norm"
    attention_share = True

    def from_attention(self, att: WindowAttention) -> Tensor:
        return _sum_rows(att.probs).mul_(att.resident.value_l1)  # [Hkv, T]


class ObcacheValue(Scorer):
    """OBCache-V: sum_r A[r, p]^2 |v_p|^2, exactly |dO|_F^2 when v_p is zeroed."""

    name = "obcache_value"

    def from_attention(self, att: WindowAttention) -> Tensor:
        a_sq = _sum_rows(att.probs.square_())  # [Hkv, T]  sum_r A^2
        return a_sq.mul_(att.resident.value_sq)  # [Hkv, T]


def _sum_rows(x: Tensor, weights: Tensor | None = None) -> Tensor:
    """sum_r weights[r] x[r, p]: [Hkv, R, T] -> [Hkv, T], as a batched matrix-vector product
    (faster on CPU than a reduction over the middle dim; vector_norm over it is far slower)."""
    if weights is None:
        weights = x.new_ones((x.shape[0], 1, x.shape[1]))  # [Hkv, 1, R]
    return torch.bmm(weights, x).squeeze(1)  # [Hkv, T]


def _distance_sq(att: WindowAttention, out: Tensor) -> Tensor:
    """|v_p - o_r|^2 [Hkv, R, T] = |v_p|^2 + |o_r|^2 - 2 o_r . v_p, the product accumulated in
    place (no [R, T, D] temporary)."""
    out_sq = out.square().sum(dim=-1, keepdim=True)  # [Hkv, R, 1]
    dist = out_sq + att.resident.value_sq.unsqueeze(1)  # [Hkv, R, T]
    return dist.baddbmm_(out, att.resident.values.transpose(1, 2), alpha=-2.0)


def _dot_outputs_values(att: WindowAttention, out: Tensor) -> Tensor:
    """o_r . v_p [Hkv, R, T]: one [R, D] x [D, T] product per KV head."""
    return torch.bmm(out, att.resident.values.transpose(1, 2))  # [Hkv, R, T]


class ObcacheKey(Scorer):
    """OBCache-K: sum_r (A Z)^2 |v_p - o_r|^2, the Gauss-Newton estimate of zeroing k_p."""

    name = "obcache_key"
    needs_logits = True

    def from_attention(self, att: WindowAttention) -> Tensor:
        dist = _distance_sq(att, att.outputs())  # [Hkv, R, T]
        weight = att.probs.mul_(att.logits).square_()  # [Hkv, R, T]  (A Z)^2, in place
        return _sum_rows(weight.mul_(dist))  # [Hkv, T]


class ObcacheJoint(Scorer):
    """OBCache-VK: sum_r |(A + Y) v_p - Y o_r|^2 with Y = A Z (value + key + cross term)."""

    name = "obcache_joint"
    needs_logits = True

    def from_attention(self, att: WindowAttention) -> Tensor:
        out = att.outputs()  # [Hkv, R, D]
        out_sq = out.square().sum(dim=-1).unsqueeze(1)  # [Hkv, 1, R]
        # = (A+Y)^2 |v|^2 - 2 (A+Y) Y v.o + Y^2 |o|^2, summed over rows term by term.
        y = att.logits.mul_(att.probs)  # [Hkv, R, T]  Y = A Z, in place
        a_plus_y = att.probs.add_(y)  # [Hkv, R, T]  A + Y, in place
        cross = _sum_rows(_dot_outputs_values(att, out).mul_(a_plus_y).mul_(y))  # [Hkv, T]
        o_term = _sum_rows(y.square_(), out_sq)  # [Hkv, T]  sum_r Y^2 |o_r|^2
        v_term = _sum_rows(a_plus_y.square_())  # [Hkv, T]  sum_r (A+Y)^2
        return v_term.mul_(att.resident.value_sq).add_(o_term).sub_(cross, alpha=2.0)  # [Hkv, T]


class DropKV(Scorer):
    """DropKV: sum_r (A / (1 - A))^2 |v_p - o_r|^2, exactly |dO|_F^2 when p alone is evicted.

    Computed in fp64 whatever the inputs (the result in their compute dtype): the weight
    divides by ``1 - A``, and near A = 1 a float32 ``|v_p - o_r|^2`` is mostly rounding (about
    10 % of it at ``1 - A = 1e-3``), which the weight then multiplies by up to 10^6. A token that
    holds all of a row's attention (``1 - A`` below fp64's eps: in practice the row's only
    visible token) would leave that row nothing, and the formula is inf * 0 there (its value is
    the row's output): that row adds 0, and the score stays finite.
    """

    name = "dropkv"

    def __call__(self, q, k, v, geom, q_pos=None, k_pos=None) -> Tensor:
        wide = torch.float64
        out = super().__call__(q.to(wide), k.to(wide), v.to(wide), geom, q_pos, k_pos)
        return out.to(compute_dtype(q, k, v))

    def from_attention(self, att: WindowAttention) -> Tensor:
        dist = _distance_sq(att, att.outputs())  # [Hkv, R, T]
        probs = att.probs
        rest = probs.neg().add_(1.0)  # [Hkv, R, T]  1 - A
        saturated = rest < torch.finfo(probs.dtype).eps
        weight = probs.div_(rest.masked_fill_(saturated, 1.0)).square_()  # (A / (1 - A))^2
        weight.masked_fill_(saturated, 0.0)
        return _sum_rows(weight.mul_(dist.clamp_min_(0.0)))  # [Hkv, T]


class KeyNorm(Scorer):
    """-|k_p|_2 per KV head (query-free). Sign as kvpress KnormPress: LOW key norms are kept."""

    name = "key_norm"
    needs_attention = False

    def __call__(self, q, k, v, geom, q_pos=None, k_pos=None) -> Tensor:
        check_shapes(None, k, v, geom)
        return -torch.linalg.vector_norm(k.to(compute_dtype(k)), dim=-1).T  # [Hkv, T]


class RandomScore(Scorer):
    """Uniform random scores, a floor baseline (query-free).

    Deterministic: every call draws from a fresh generator seeded with ``seed``, so the result
    depends only on (seed, Hkv, T); the same stream is drawn on every layer and step.
    """

    name = "random"
    needs_attention = False

    def __init__(self, seed: int = 0) -> None:
        self.seed = int(seed)

    def __call__(self, q, k, v, geom, q_pos=None, k_pos=None) -> Tensor:
        check_shapes(None, k, v, geom)
        gen = torch.Generator(device="cpu").manual_seed(self.seed)
        shape = (geom.num_kv_heads, k.shape[0])
        draws = torch.rand(
            shape, generator=gen, dtype=torch.float32
        )  # [Hkv, T], same for any dtype
        return draws.to(device=k.device, dtype=compute_dtype(k))

    def __repr__(self) -> str:
        return f"RandomScore(seed={self.seed})"


_SCORERS: dict[str, type[Scorer]] = {
    cls.name: cls
    for cls in (
        AttentionMass,
        ValueNorm,
        ObcacheValue,
        ObcacheKey,
        ObcacheJoint,
        DropKV,
        KeyNorm,
        RandomScore,
    )
}
SCORER_NAMES: tuple[str, ...] = tuple(_SCORERS)


def make_scorer(name: str, **kwargs) -> Scorer:
    """The scorer called ``name`` (one of SCORER_NAMES); kwargs go to its constructor."""
    try:
        cls = _SCORERS[name]
    except KeyError:
        raise ValueError(f"unknown scorer {name!r}; known: {', '.join(SCORER_NAMES)}") from None
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ValueError(f"bad options for scorer {name!r}: {exc}") from None
