"""RunningScores bookkeeping, and a decode replay: prefill + per-step scores + evictions must
equal the H2O sum over every query seen, recomputed per KV head and LOGICAL token.

Glossary: Hkv KV heads, Hq query heads, G = Hq // Hkv, D head dim, T resident, K kept.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from obcache_vllm.scoring import (
    HeadGeometry,
    RunningScores,
    make_pipeline,
    make_scorer,
    select_keep,
)

pytestmark = pytest.mark.unit

F64 = torch.float64


def test_add_pads_new_entries_with_zero_then_sums():
    rs = RunningScores(2)
    assert rs.length == 0 and rs.scores.shape == (2, 0)
    rs.add(torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]))
    rs.add(torch.tensor([[1.0, 1.0, 1.0, 7.0, 8.0], [1.0, 1.0, 1.0, 9.0, 0.5]]))
    assert rs.length == 5 and rs.scores.dtype == torch.float32
    assert rs.scores.tolist() == [[2.0, 3.0, 4.0, 7.0, 8.0], [5.0, 6.0, 7.0, 9.0, 0.5]]


def test_last_mode_replaces():
    rs = make_pipeline("tova").make_running(2)
    assert rs.mode == "last"
    rs.add(torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    rs.add(torch.tensor([[5.0, 6.0, 7.0], [8.0, 9.0, 1.0]]))
    assert rs.scores.tolist() == [[5.0, 6.0, 7.0], [8.0, 9.0, 1.0]]


def test_gather_keeps_columns_per_head_and_new_entries_start_at_zero():
    rs = RunningScores(2)
    rs.add(torch.tensor([[0.0, 1.0, 2.0, 3.0], [10.0, 11.0, 12.0, 13.0]]))
    rs.gather(torch.tensor([[0, 3], [1, 2]]))
    assert rs.length == 2 and rs.scores.tolist() == [[0.0, 3.0], [11.0, 12.0]]
    rs.add(torch.ones(2, 4))  # two new entries appended after the eviction
    assert rs.scores.tolist() == [[1.0, 4.0, 1.0, 1.0], [12.0, 13.0, 1.0, 1.0]]


def test_growth_over_many_steps_and_reset():
    rs = RunningScores(3, dtype=F64)
    for t in range(1, 200):
        rs.add(torch.ones(3, t, dtype=F64))
    # Entry p was resident for steps p+1 .. 199.
    assert rs.scores[1].tolist() == [float(199 - p) for p in range(199)]
    rs.reset()
    assert rs.length == 0
    rs.add(torch.ones(3, 2, dtype=F64))
    assert rs.scores.tolist() == [[1.0, 1.0]] * 3


def test_validation():
    rs = RunningScores(2)
    rs.add(torch.zeros(2, 4))
    with pytest.raises(ValueError, match="fewer"):
        rs.add(torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"\[2, T\]"):
        rs.add(torch.zeros(3, 4))
    with pytest.raises(ValueError, match="cannot keep"):
        rs.gather(torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(ValueError):
        RunningScores(2, mode="max")
    assert make_pipeline("streaming").make_running(2) is None
    assert make_pipeline("h2o").make_running(2).mode == "sum"


# ---------------------------------------------------------------- decode replay


def naive_contribution(kind, q_row, keys, values, geom):
    """Score of ONE query q_row [Hq, D] over per-head residents keys/values [Hkv][T_h, D]."""
    out = []
    for kv in range(geom.num_kv_heads):
        acc = torch.zeros(keys[kv].shape[0], dtype=F64)
        for h in range(kv * geom.group, (kv + 1) * geom.group):
            z = keys[kv] @ q_row[h] * geom.scale  # [T]
            a = torch.softmax(z, dim=0)  # [T]
            o = a @ values[kv]  # [D]
            if kind == "attn":
                acc += a
            else:  # obcache_key
                acc += (a * z).square() * (values[kv] - o).square().sum(-1)
        out.append(acc)
    return out


@pytest.mark.parametrize(
    "kind", [pytest.param("attn", id="h2o"), pytest.param("obcache_key", id="h2o+obcache_k")]
)
@pytest.mark.parametrize(
    "budget,recent,sinks",
    [pytest.param(10, 3, 1, id="K10-R3-S1"), pytest.param(6, 2, 0, id="K6-R2")],
)
def test_decode_accumulation_equals_h2o_sum_over_all_queries_seen(kind, budget, recent, sinks):
    geom = HeadGeometry(9, 3, 8)
    prompt, total = 14, 40
    gen = torch.Generator().manual_seed(budget)
    q_all = 2.0 * torch.randn(total, 9, 8, generator=gen, dtype=F64)
    k_all = torch.randn(total, 3, 8, generator=gen, dtype=F64)
    v_all = torch.randn(total, 3, 8, generator=gen, dtype=F64)
    scorer, pipe = make_scorer(kind), make_pipeline("h2o")

    # System under test: prefill, evict, then one scored query per step, evicting over budget.
    rs = pipe.make_running(3, dtype=F64)
    logical = torch.arange(prompt).expand(3, prompt).clone()  # [Hkv, T] logical positions
    rs.add(pipe.prefill_scores(scorer, q_all[:prompt], k_all[:prompt], v_all[:prompt], geom))
    # Oracle: per head, logical token -> accumulated score, and per-head resident lists.
    oracle = [defaultdict(float) for _ in range(3)]
    for i in range(prompt):
        causal = [k_all[: i + 1, kv] for kv in range(3)], [v_all[: i + 1, kv] for kv in range(3)]
        for kv, contrib in enumerate(naive_contribution(kind, q_all[i], *causal, geom)):
            for p, s in enumerate(contrib.tolist()):
                oracle[kv][p] += s
    resident = [list(range(prompt)) for _ in range(3)]
    evictions = 0

    def evict():
        nonlocal logical, evictions
        keep = select_keep(rs.scores, keep=budget, recent=recent, sinks=sinks)  # [Hkv, K]
        rs.gather(keep)
        logical = logical.gather(1, keep)
        for kv in range(3):
            resident[kv] = [resident[kv][j] for j in keep[kv].tolist()]
        evictions += 1

    evict()
    for t in range(prompt, total):
        logical = torch.cat([logical, torch.full((3, 1), t)], dim=1)
        for kv in range(3):
            resident[kv].append(t)
        k_res = torch.stack([k_all[logical[kv], kv] for kv in range(3)], dim=1)  # [T, Hkv, D]
        v_res = torch.stack([v_all[logical[kv], kv] for kv in range(3)], dim=1)
        rs.add(scorer(q_all[t : t + 1], k_res, v_res, geom))  # W = 1, all residents visible
        keys = [k_all[resident[kv], kv] for kv in range(3)]
        values = [v_all[resident[kv], kv] for kv in range(3)]
        for kv, contrib in enumerate(naive_contribution(kind, q_all[t], keys, values, geom)):
            for p, s in zip(resident[kv], contrib.tolist(), strict=True):
                oracle[kv][p] += s
        if rs.length > budget:
            evict()

    assert evictions == 1 + (total - prompt)
    assert logical.tolist() == resident  # the cache and the oracle agree on who is resident
    expected = torch.tensor([[oracle[kv][p] for p in resident[kv]] for kv in range(3)], dtype=F64)
    torch.testing.assert_close(rs.scores, expected, rtol=1e-11, atol=1e-13)
    assert (logical[:, :sinks] == torch.arange(sinks)).all()
    assert (logical[:, -recent:] == torch.arange(total - recent, total)).all()
    assert not all(logical[0].tolist() == row for row in logical.tolist())  # heads diverged
