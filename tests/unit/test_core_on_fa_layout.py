"""The backend-agnostic core driving the FlashAttention view, on CPU tensors (no GPU, no engine).

``evict_after_attention`` (what every OBCacheFlashAttnImpl layer runs after FA's attention) on
a real vLLM 0.32 FA-layout cache: it keeps exactly what the pipeline selects, writes it where
the next step's shifted reads find it, and the next decode step attends exactly to the kept
tokens. Under tensor parallelism every rank enters each shared-ranking row's all-reduce once
per layer, also after a local fault (the collective must never be left waiting).

Glossary: ``N`` prompt tokens, ``K`` kept per head, ``Hq``/``Hkv`` heads, ``D`` head dim.
"""

from __future__ import annotations

import pytest
import torch

from obcache_vllm.admission import parse_kv_options
from obcache_vllm.eviction.faults import Fault, FaultyView
from obcache_vllm.eviction.layer import evict_after_attention
from obcache_vllm.eviction.messages import EvictionOrder
from obcache_vllm.eviction.paged import shift_rows_in_place
from obcache_vllm.eviction.step import RequestKvState, RowPlan, StepPlan
from obcache_vllm.evidence.kernel_checks.paged import (
    paged_attention_reference,
    sdpa_gqa,
    write_slots,
)
from obcache_vllm.scoring import HeadGeometry
from obcache_vllm.vllm_ext.worker.backends.flash_attn_layout import (
    FlashAttnKvView,
    layer_cache_views,
)

BS, HQ, HKV, D, WIDTH = 16, 4, 2, 32, 8
GEOM = HeadGeometry(HQ, HKV, D)


def _request(gen, caches, row: torch.Tensor, n: int):
    """Random prompt KV [n, Hkv, D] written through the logical row of every layer's cache,
    and the prompt's queries [n, Hq, D]."""
    k, v = torch.randn((2, n, HKV, D), generator=gen)
    for cache in caches:
        write_slots(cache, row, 0, k, v)
    return k, v, torch.randn((n, HQ, D), generator=gen)


def _row(index, kv, n, order, q_start, prompt_len=None) -> RowPlan:
    options = parse_kv_options(kv, prompt_len or n, 4096)
    state = RequestKvState.create(options)
    state.record = {}
    return RowPlan(
        index, f"r{index}", BS, state, q_start, q_start + n, n, prompt_len or n, True, order
    )


@pytest.mark.parametrize("per_head", [pytest.param(True, id="per-head"), False])
@pytest.mark.parametrize("layout", ["LBNHC", "BLHNC"])
def test_compaction_through_the_fa_view_then_shifted_decode(layout, per_head):
    gen = torch.Generator().manual_seed(3)
    n, budget = 100, 40
    cache = layer_cache_views(2, 24, HKV, BS, D, layout, torch.float32)[0]
    logical = torch.zeros((1, WIDTH), dtype=torch.int32)
    logical[0, :7] = torch.randperm(23, generator=gen)[:7].int() + 1
    table = logical.clone()  # the step's persistent device table
    k, v, q = _request(gen, [cache], table[0], n)
    dead = (n - budget) // BS
    order = EvictionOrder(logical_len=n, dead_before=0, dead_after=dead, block_size=BS)
    kv = {"kv_budget": budget, "kv_pipeline": "snapkv", "kv_window": 8, "kv_per_head": per_head}
    row = _row(0, kv, n, order, 0)
    plan = StepPlan(dead=(0,), rows=(row,), block_size=BS)
    plan.read_block_table = table
    evict_after_attention(plan, "layer", q, FlashAttnKvView(cache, D), GEOM)
    assert row.outcome.failure is None and row.outcome.compacted_layers == 1

    # The pipeline's own selection on the original tensors (positions: the prompt's last 8).
    state = row.state
    scores = state.pipeline.prefill_scores(
        state.scorer, q[-8:], k, v, GEOM, torch.arange(n - 8, n), torch.arange(n)
    )
    opts = state.options
    expected = state.pipeline.select(scores, order.kept, recent=opts.recent, sinks=opts.sinks)
    keep = state.record["layer"]  # [Hkv, K]
    assert torch.equal(keep, expected) and keep.shape == (HKV, n - dead * BS)
    assert per_head or (keep == keep[0]).all()

    # Next step: one decode token written through the LOGICAL table, then the shifted read.
    k1, v1 = torch.randn((2, 1, HKV, D), generator=gen)
    write_slots(cache, logical[0], n, k1, v1)
    seq_lens = torch.tensor([n + 1], dtype=torch.int32)
    shift_rows_in_place(table, seq_lens, torch.tensor([dead], dtype=torch.int32), BS)
    q1 = torch.randn((1, HQ, D), generator=gen)
    got = paged_attention_reference(q1, cache, table, seq_lens, torch.tensor([0, 1]), GEOM.scale)
    index = keep.unsqueeze(-1).expand(-1, -1, D)  # [Hkv, K, D]
    keys = torch.cat([k.transpose(0, 1).gather(1, index), k1.transpose(0, 1)], dim=1)
    values = torch.cat([v.transpose(0, 1).gather(1, index), v1.transpose(0, 1)], dim=1)
    visible = torch.ones((1, keys.shape[1]), dtype=torch.bool)
    want = sdpa_gqa(q1, keys, values, visible, GEOM.scale)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_every_rank_joins_each_shared_rows_collective_once_per_layer():
    """A: shared ranking with an order; B: per-head (no collective); C: shared, a local fault
    in its first layer (it still joins, with zeros); D: shared, no order yet (no collective)."""
    gen = torch.Generator().manual_seed(4)
    caches = layer_cache_views(2, 40, HKV, BS, D, "LBNHC", torch.float32)
    table = (torch.randperm(39, generator=gen)[:32].int() + 1).view(4, WIDTH)
    lens = {"A": 90, "B": 80, "C": 70, "D": 60}
    queries, rows, start = [], [], 0
    for i, (name, n) in enumerate(lens.items()):
        queries.append(_request(gen, caches, table[i], n)[2])
        shared = name != "B"
        kv = {"kv_budget": 40, "kv_pipeline": "tova", "kv_per_head": not shared}
        order = None if name == "D" else EvictionOrder(n, 0, (n - 40) // BS, BS)
        rows.append(_row(i, kv, n, order, start, prompt_len=n + (name == "D")))
        start += n
    calls = []

    def all_reduce(t: torch.Tensor) -> torch.Tensor:  # one rank's view of the collective
        calls.append((tuple(t.shape), bool(t.any())))
        return t

    query = torch.cat(queries)
    plan = StepPlan(dead=(0,) * 4, rows=tuple(rows), block_size=BS, head_reduce=all_reduce)
    plan.read_block_table = table
    for layer, cache in zip(("l0", "l1"), caches, strict=True):
        # C's fault is injected the way OBCACHE_VLLM_FAULTS=1 does: through its view.
        view = FaultyView(FlashAttnKvView(cache, D), table, {2: Fault("score")}, None)
        evict_after_attention(plan, layer, query, view, GEOM)
    joined = [((1, 90), True), ((1, 70), False)]  # A with its scores, C with zeros
    assert calls == joined * 2
    a, b, c, d = rows
    assert a.outcome.compacted_layers == b.outcome.compacted_layers == 2
    assert c.outcome.failure[:2] == ("score", "injected") and c.outcome.compacted_layers == 0
    assert d.outcome.compacted_layers == 0 and d.outcome.failure is None
    assert (a.state.record["l1"] == a.state.record["l1"][0]).all()  # one ranking per layer


def test_adakv_on_a_view_that_cannot_read_per_head_is_a_contained_fault_before_any_write():
    """A backend without per-head memory (this FlashAttention view) never gets a per-head
    layout: the row fails in its first layer, nothing written, and goes on uncompressed."""
    gen = torch.Generator().manual_seed(5)
    n, budget = 100, 40
    cache = layer_cache_views(2, 24, HKV, BS, D, "LBNHC", torch.float32)[0]
    table = torch.zeros((1, WIDTH), dtype=torch.int32)
    table[0, :7] = torch.randperm(23, generator=gen)[:7].int() + 1
    q = _request(gen, [cache], table[0], n)[2]
    before = cache.clone()
    order = EvictionOrder(logical_len=n, dead_before=0, dead_after=(n - budget) // BS,
                          block_size=BS)  # fmt: skip
    row = _row(0, {"kv_budget": budget, "kv_pipeline": "adakv", "kv_window": 8}, n, order, 0)
    plan = StepPlan(dead=(0,), rows=(row,), block_size=BS)
    plan.read_block_table = table
    evict_after_attention(plan, "layer", q, FlashAttnKvView(cache, D), GEOM)
    stage, reason, _ = row.outcome.failure
    assert (stage, reason) == ("score", "NotImplementedError")
    assert row.outcome.compacted_layers == 0 and not row.outcome.torn(1)
    assert torch.equal(cache, before)
