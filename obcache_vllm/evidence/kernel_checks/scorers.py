"""The scorers on a device: exactness against fp64 on CPU, cost against an SDPA prefill.

Exactness: the same random q, k, v (stored in the cache dtype, as a paged cache holds them) are
scored on the device (fp32 math) and on CPU in fp64; the error is relative to the largest fp64
score of the head, and the kept sets (top quarter, per head) are compared.

Cost: one layer of one request at prefill end, T resident tokens, the last W = 64 prompt queries
(SnapKV's window) against a causal ``scaled_dot_product_attention`` prefill of the same T
tokens and heads (what the attention of that layer costs anyway). The paper's claim (OBCache,
arXiv 2510.07651): the value score costs about what the attention-mass score costs, the key
and joint scores a small constant more. The k/v passed are ``transpose(0, 1)`` views of
[Hkv, T, D] tensors, the layout the FlashAttention view's gather produces.

Glossary: ``W`` window queries, ``T`` resident tokens, ``Hq``/``Hkv`` heads, ``D`` head dim.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from obcache_vllm.evidence.kernel_checks import Row, within
from obcache_vllm.scoring import HeadGeometry, make_scorer, select_keep

EXACT_SCORERS = ("attn", "value_norm", "obcache_value", "obcache_key", "obcache_joint", "dropkv",
                 "key_norm")
TIMED_SCORERS = ("attn", "obcache_value", "obcache_key", "obcache_joint")


def _inputs(geom: HeadGeometry, window: int, tokens: int, dtype, device, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn((window, geom.num_q_heads, geom.head_dim), generator=gen)  # [W, Hq, D]
    kv = torch.randn((2, geom.num_kv_heads, tokens, geom.head_dim), generator=gen)
    kv[0] *= 2.0  # sharper attention than unit keys give: non-trivial scores
    q, kv = q.to(dtype).to(device), kv.to(dtype).to(device)
    return q, kv[0].transpose(0, 1), kv[1].transpose(0, 1)  # k, v [T, Hkv, D] views


def check_exactness(device, geom: HeadGeometry, tokens: int, window: int, dtype) -> list[Row]:
    """Each scorer on ``device`` vs fp64 on CPU; kept-set agreement at T/4 per head."""
    q, k, v = _inputs(geom, window, tokens, dtype, device)
    q64, k64, v64 = (x.cpu().double() for x in (q, k, v))
    rows = []
    case = f"T={tokens} W={window} {str(dtype).removeprefix('torch.')}"
    for name in EXACT_SCORERS:
        scorer = make_scorer(name)
        got = scorer(q, k, v, geom).double().cpu()  # [Hkv, T]
        ref = scorer(q64, k64, v64, geom)  # [Hkv, T] fp64
        scale = ref.abs().amax(dim=1, keepdim=True).clamp_min(1e-300)
        err = ((got - ref).abs() / scale).max()
        keep = max(1, tokens // 4)
        a = select_keep(got, keep=keep)
        b = select_keep(ref, keep=keep)
        overlap = torch.tensor(
            [len(set(a[h].tolist()) & set(b[h].tolist())) / keep for h in range(a.shape[0])]
        ).min()
        rows.append(within("exact", f"{name} {case}", "max rel err vs fp64 CPU", err, 1e-4))
        rows.append(
            within("exact", f"{name} {case}", "1 - kept overlap (worst head)", 1 - overlap, 0.01)
        )
    return rows


def _synchronize(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], device, repeats: int = 5) -> float:
    """Median wall time of ``fn`` in ms (one warm-up call; the device drained around each)."""
    fn()
    times = []
    for _ in range(repeats):
        _synchronize(device)
        start = time.perf_counter()
        fn()
        _synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def time_scorers(
    device, geom: HeadGeometry, tokens: int, window: int = 64, dtype=torch.bfloat16,
    chunk_elements: int | None = None, repeats: int = 5,
) -> list[Row]:  # fmt: skip
    """ms of an SDPA prefill of T tokens, and of each scorer (also as % of the prefill)."""
    q, k, v = _inputs(geom, window, tokens, dtype, device, seed=1)
    # The prefill of the same layer: T causal queries over T keys, all Hq heads (GQA expanded).
    group = geom.group
    pq = torch.randn((1, geom.num_q_heads, tokens, geom.head_dim), dtype=dtype, device=device)
    pk = k.transpose(0, 1).repeat_interleave(group, 0).unsqueeze(0)  # [1, Hq, T, D]
    pv = v.transpose(0, 1).repeat_interleave(group, 0).unsqueeze(0)

    def prefill():
        return F.scaled_dot_product_attention(pq, pk, pv, is_causal=True)

    base = time_ms(prefill, device, repeats)
    chunk = "default" if chunk_elements is None else f"{chunk_elements / 2**20:g}Mi"
    case = f"T={tokens} W={window} chunk={chunk}"
    rows = [Row("speed", case, "sdpa prefill ms", base)]
    for name in TIMED_SCORERS:
        scorer = make_scorer(name)
        if chunk_elements is not None:
            scorer.chunk_elements = chunk_elements
        ms = time_ms(lambda s=scorer: s(q, k, v, geom), device, repeats)
        rows.append(Row("speed", case, f"{name} ms", ms, note=f"{100 * ms / base:.1f}% of sdpa"))
    return rows
