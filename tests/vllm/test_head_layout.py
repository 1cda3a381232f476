"""Attention over per-head caches on vLLM's CPU kernel (no engine): the regrouping the per-head
memory design relies on (docs/contributing/per_head_memory.md), as
benchmarks/bench_head_layout.py times it.

Every (request, KV head) keeps its own number of tokens in its own head-blocks, written by
vLLM's cache kernel (``cpu_attn_reshape_and_cache``) through the head-block view of an
ordinary cache; the regrouped ``cpu_attention_with_kv_cache`` call (one sequence per request
and KV head, its G query heads) must equal attention computed in torch over exactly those
kept tokens, per query head, for decode and for a causal prefill chunk.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.vllm]

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_head_layout.py"
_spec = importlib.util.spec_from_file_location("bench_head_layout", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)
HQ, HKV, D, BS, G = bench.HQ, bench.HKV, bench.D, bench.BS, bench.G


@pytest.mark.parametrize("chunk", [1, 4])
def test_regrouped_attention_is_attention_over_each_heads_kept_tokens(chunk):
    from vllm import _custom_ops as ops

    gen = torch.Generator().manual_seed(chunk)
    kept = [[70, 33, 9], [12, 64, 40]]  # [request][KV head], the chunk's tokens included
    requests, blocks = len(kept), 40
    cache = torch.zeros(blocks, HKV, BS, 2 * D)
    heads = cache.view(blocks * HKV, 1, BS, 2 * D)  # head-block b * HKV + h
    key_cache, value_cache = heads.view(blocks * HKV, 1, 2 * BS, D).chunk(2, dim=2)
    free = (torch.randperm(blocks * HKV - HKV, generator=gen) + HKV).tolist()  # not block 0
    width = max(-(-n // BS) for row in kept for n in row)
    table = torch.zeros(requests * HKV, width, dtype=torch.int32)
    kv = {}
    for r in range(requests):
        for h in range(HKV):
            n = kept[r][h]
            ids = [free.pop() for _ in range(-(-n // BS))]
            table[r * HKV + h, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
            k, v = torch.randn(n, 1, D, generator=gen), torch.randn(n, 1, D, generator=gen)
            slots = torch.tensor([ids[i // BS] * BS + i % BS for i in range(n)])
            ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, "vec")
            kv[r, h] = (k[:, 0], v[:, 0])
    query = torch.randn(requests * chunk, HQ, D, generator=gen)
    seq = [kept[r][h] for r in range(requests) for h in range(HKV)]
    out = bench.attend(bench.regroup(query, requests, chunk), heads, table, seq,
                       [chunk] * (requests * HKV), G, 1, "vec")  # fmt: skip
    got = bench.ungroup(out, requests, chunk).view(requests, chunk, HQ, D)
    q = query.view(requests, chunk, HQ, D)
    for r in range(requests):
        for qh in range(HQ):
            k, v = kv[r, qh // G]  # vLLM's GQA: query head q reads KV head q // G
            n = len(k)
            for i in range(chunk):  # query i sits at position n - chunk + i: causal
                visible = n - chunk + i + 1
                w = torch.softmax(q[r, i, qh] @ k[:visible].T * D**-0.5, -1)
                torch.testing.assert_close(got[r, i, qh], w @ v[:visible], rtol=1e-5, atol=1e-5)


def test_regrouped_equals_stock_when_every_head_keeps_the_same_tokens():
    row = bench.check_case(requests=3, tokens=96, chunk=1, dtype=torch.float32)
    assert row["max_diff"] <= 1e-6 and row["max_diff_uneven"] <= 1e-6
    row = bench.check_case(requests=2, tokens=160, chunk=8, dtype=torch.float32)
    assert row["max_diff"] <= 1e-6 and row["max_diff_uneven"] <= 1e-6
