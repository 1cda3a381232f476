"""Budgets by error target: the error of every kept count of one layer, from its scored window.

**Window pipelines** (``snapkv``, ``tova``): the error of keeping K tokens is the relative
squared change of the window queries' attention outputs when everything the selection would
not keep at K is evicted (:func:`window_error_curve`)::

    error(K) = sum_r |o_r(K) - o_r|^2 / sum_r |o_r|^2

with ``o_r`` the output of window row r (one query of one query head) over all resident tokens
and ``o_r(K)`` its output over the kept ones, the softmax renormalised over them as the model's
attention will be. It is exact for the layer's window outputs (not an additive sum of per-token
estimates: evicting two copies of one token counts what losing both does), whatever scorer
ranks the tokens, and it costs about one more attention of the window over the resident tokens.

**h2o** (every prompt query, none kept): only the scorer's own sums are left. With a score that
is a share of attention (``attn``; ``value_norm``, weighted by |v_p|_1), the error of K is the
share lost, ``sum_evicted S / sum_all S`` (:func:`share_curve`).

A layer's error is the mean over its KV heads; a request's, the mean over its layers
(:func:`choose` reads that mean). The first ``sinks`` and last ``recent`` tokens are kept at
every count, ties go to the lower index and NaN ranks lowest, as in ``select_keep``.

Glossary: Hkv KV heads, G query heads per KV head, W window queries, R = G * W window rows per
KV head, T resident tokens, D head dim, C candidate kept counts, bs their spacing.
"""

from __future__ import annotations

import torch
from torch import Tensor

from obcache_vllm.scoring.attention import (
    Resident,
    attend,
    chunk_budget,
    compute_dtype,
    queries_per_chunk,
    resolve_positions,
)
from obcache_vllm.scoring.geometry import HeadGeometry


def keep_order(ranking: Tensor, *, recent: int = 0, sinks: int = 0,
               per_head: bool = True) -> Tensor:  # fmt: skip
    """Resident indices per KV head, best first, as ``Pipeline.select`` ranks them: the first
    K of a row are the K it keeps. ``ranking`` [Hkv, T] (summed over heads first when
    ``per_head`` is False) -> LongTensor [Hkv, T]."""
    heads, num_t = ranking.shape
    if not per_head:
        ranking = ranking.sum(dim=0, keepdim=True).expand(heads, num_t)
    priority = ranking.to(torch.float64).nan_to_num(nan=float("-inf"))
    fixed = torch.zeros(num_t, dtype=torch.bool, device=ranking.device)
    fixed[: min(sinks, num_t)] = True
    if recent:
        fixed[max(0, num_t - recent) :] = True
    priority = priority.masked_fill(fixed, float("inf"))
    return torch.sort(priority, dim=1, descending=True, stable=True).indices


def share_curve(scores: Tensor, kept: Tensor, *, ranking: Tensor | None = None,
                recent: int = 0, sinks: int = 0, per_head: bool = True) -> Tensor:  # fmt: skip
    """The share of ``scores`` [Hkv, T] lost at each count of ``kept`` [C], mean over heads,
    [C] fp64 (``ranking``: what the selection ranks by; the scores themselves by default)."""
    heads, num_t = scores.shape
    order = keep_order(scores if ranking is None else ranking, recent=recent, sinks=sinks,
                       per_head=per_head)  # fmt: skip
    values = scores.to(torch.float64).gather(1, order)  # [Hkv, T] best first
    # tail[:, K] = everything ranked below the first K (exactly 0 when all are kept).
    tail = torch.cat([values.flip(1).cumsum(dim=1).flip(1), values.new_zeros((heads, 1))], 1)
    evicted = tail[:, kept.to(device=scores.device, dtype=torch.int64).clamp(0, num_t)]
    total = values.sum(dim=1, keepdim=True)  # [Hkv, 1]
    return torch.where(total > 0, evicted.clamp_min(0) / total.clamp_min(1e-300), 0.0).mean(0)


def window_error_curve(
    q: Tensor, k: Tensor, v: Tensor, geom: HeadGeometry, ranking: Tensor, kept: Tensor,
    *, q_pos: Tensor | None = None, k_pos: Tensor | None = None, recent: int = 0,
    sinks: int = 0, per_head: bool = True,
) -> Tensor:  # fmt: skip
    """The relative squared change of the window outputs at each count of ``kept`` [C], mean
    over KV heads, [C] fp64 (see the module docstring).

    q [W, Hq, D] (positions ``q_pos``), k, v [T, Hkv, D] (``k_pos``); ``ranking`` [Hkv, T]:
    what the selection ranks by. ``kept``: counts ``K_min + i * bs`` for ``i = 0..C-1`` with
    the largest at most T (the block-aligned candidates of an order); any spacing works, the
    sums are taken per stretch between consecutive counts.
    """
    num_w, num_t = q.shape[0], k.shape[0]
    counts = sorted(set(int(c) for c in kept.tolist()))
    if num_w == 0 or num_t == 0 or counts[0] >= num_t:
        return torch.zeros(len(kept), dtype=torch.float64)
    q_pos, k_pos = resolve_positions(num_w, num_t, q_pos, k_pos, k.device)
    dtype = torch.float64 if compute_dtype(q, k, v) == torch.float64 else torch.float32
    order = keep_order(ranking, recent=recent, sinks=sinks, per_head=per_head)  # [Hkv, T]
    res = Resident.from_kv(k, v, k_pos, dtype)
    values = res.values.gather(1, order.unsqueeze(-1).expand(-1, -1, res.values.shape[-1]))
    # Stretches of the ranked tokens: [counts[i], counts[i+1]) and [counts[-1], T); the
    # tokens evicted at counts[i] are the stretches from i on.
    bounds = [c for c in counts if c < num_t] + [num_t]
    stretches = list(zip(bounds[:-1], bounds[1:], strict=True))
    heads = geom.num_kv_heads
    change = torch.zeros((heads, len(stretches)), dtype=torch.float64, device=k.device)
    energy = torch.zeros(heads, dtype=torch.float64, device=k.device)
    step = queries_per_chunk(geom, num_t, chunk_budget(k.device))
    for start in range(0, num_w, step):
        att = attend(q[start : start + step], res, geom, q_pos[start : start + step],
                     keep_logits=False)  # fmt: skip
        out = att.outputs()  # [Hkv, R, D]
        probs = att.probs.gather(2, order.unsqueeze(1).expand(-1, out.shape[1], -1))  # ranked
        # Per stretch s: the attention it holds (m) and the output part it gives (a v).
        mass = torch.stack([probs[..., a:b].sum(-1) for a, b in stretches], -1)  # [Hkv, R, S]
        part = torch.stack([torch.bmm(probs[..., a:b], values[:, a:b]) for a, b in stretches],
                           2)  # [Hkv, R, S, D]  # fmt: skip
        # Evicted at counts[i]: the stretches from i on (suffix sums over S).
        m = mass.flip(-1).cumsum(-1).flip(-1)  # [Hkv, R, S]
        p = part.flip(2).cumsum(2).flip(2)  # [Hkv, R, S, D]
        # o(K) = (o - p) / (1 - m): the softmax over the kept tokens alone.
        delta = (out.unsqueeze(2) * m.unsqueeze(-1) - p) / (1 - m).clamp_min(1e-12).unsqueeze(-1)
        change += delta.to(torch.float64).square().sum(dim=(1, 3))  # [Hkv, S]
        energy += out.to(torch.float64).square().sum(dim=(1, 2))
    ratio = torch.where(energy[:, None] > 0, change / energy.clamp_min(1e-300)[:, None], 0.0)
    by_count = dict(zip(bounds[:-1], ratio.mean(0).tolist(), strict=True))
    return torch.tensor([by_count.get(int(c), 0.0) for c in kept.tolist()], dtype=torch.float64)


def choose(curve: Tensor, max_error: float) -> int:
    """The index of the smallest candidate whose error is at most ``max_error``.

    ``curve`` [C]: the request's error (mean over layers) for candidates ordered from the
    fewest kept tokens to the most; the last one keeps everything (error 0) and is chosen when
    nothing else is within the target. Evicting more never lowers the error of a share
    (``share_curve``); the window error nearly always rises too, and the first candidate
    within the target is taken either way.
    """
    within = (curve <= max_error).nonzero()
    return int(within[0]) if within.numel() else curve.numel() - 1
