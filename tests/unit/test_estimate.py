"""Budgets by error target on plain tensors: the estimate of every kept count, the choice, and
the deferred order (every layer scores, nothing is written, then one count for all layers).

Oracles: ``select_keep`` itself (the error of K is that of evicting what it leaves out), a
direct fp64 attention over the kept tokens (the window outputs' exact change), and the
per-layer selection at the chosen count.
"""

from __future__ import annotations

import pytest
import torch

from obcache_vllm.admission import parse_kv_options, parse_request, resolve
from obcache_vllm.eviction.layer import evict_after_attention, finish_deferred
from obcache_vllm.eviction.messages import EvictionOrder
from obcache_vllm.eviction.step import RequestKvState, RowPlan, StepPlan
from obcache_vllm.evidence.kernel_checks.paged import write_slots
from obcache_vllm.options import KvOptionsError
from obcache_vllm.scoring import HeadGeometry, estimate, select_keep
from obcache_vllm.vllm_ext.worker.backends.flash_attn_layout import (
    FlashAttnKvView,
    layer_cache_views,
)

pytestmark = pytest.mark.unit

BS, HQ, HKV, D = 16, 4, 2, 32
GEOM = HeadGeometry(HQ, HKV, D)


@pytest.mark.parametrize(("recent", "sinks"), [(0, 0), (5, 3)])
@pytest.mark.parametrize("per_head", [True, False])
def test_the_share_curve_is_what_the_selection_leaves_out(per_head, recent, sinks):
    gen = torch.Generator().manual_seed(0)
    scores = torch.rand((HKV, 90), generator=gen, dtype=torch.float64)
    ranking = scores + 0.3 * torch.rand((HKV, 90), generator=gen, dtype=torch.float64)
    kept = torch.tensor([10, 20, 45, 89, 90])
    curve = estimate.share_curve(scores, kept, ranking=ranking, recent=recent, sinks=sinks,
                                 per_head=per_head)  # fmt: skip
    rank = ranking if per_head else ranking.sum(0, keepdim=True).expand_as(ranking)
    for i, k in enumerate(kept.tolist()):
        keep = select_keep(rank, keep=k, recent=recent, sinks=sinks)
        lost = scores.sum(1) - scores.gather(1, keep).sum(1)
        want = (lost / scores.sum(1)).mean().item()
        assert curve[i].item() == pytest.approx(want, rel=1e-12, abs=1e-15)
    assert curve[-1] == 0.0 and bool((curve[:-1] >= curve[1:]).all())


def _outputs(q, k, v, q_pos, k_pos, keep=None):
    """Causal fp64 attention outputs [Hkv, G, W, D] over all keys, or per KV head over the
    kept ones (``keep`` [Hkv, K]), the softmax renormalised over them."""
    g = HQ // HKV
    logits = torch.einsum("whd,nhd->hwn", q, k.repeat_interleave(g, 1)) * GEOM.scale
    hidden = k_pos[None, None, :] > q_pos[None, :, None]  # [1, W, T]
    if keep is not None:
        dropped = torch.ones((HKV, k.shape[0]), dtype=torch.bool)
        dropped.scatter_(1, keep, False)
        hidden = hidden | dropped.repeat_interleave(g, 0)[:, None, :]
    probs = logits.masked_fill(hidden, float("-inf")).softmax(-1)  # [Hq, W, T]
    out = torch.einsum("hwn,nhd->hwd", probs, v.repeat_interleave(g, 1))
    return out.reshape(HKV, g, *out.shape[1:])


@pytest.mark.parametrize(("recent", "sinks"), [(0, 0), (6, 2)])
@pytest.mark.parametrize("per_head", [True, False])
def test_the_window_curve_is_the_exact_change_of_the_window_outputs(per_head, recent, sinks):
    """The error of every count is the relative squared change of the window's outputs when
    the tokens the selection leaves out are gone (the softmax renormalised): computed here
    directly, one count at a time, in fp64."""
    gen = torch.Generator().manual_seed(2)
    n, w, bs = 100, 6, 8
    q = torch.randn((w, HQ, D), generator=gen, dtype=torch.float64)
    k, v = torch.randn((2, n, HKV, D), generator=gen, dtype=torch.float64)
    q_pos, k_pos = torch.arange(n - w, n) + 40, torch.arange(n) + 40  # after 40 dead slots
    ranking = torch.rand((HKV, n), generator=gen, dtype=torch.float64)
    kept = torch.tensor([n - i * bs for i in range(9, -1, -1)])  # 28, 36, ..., 100
    curve = estimate.window_error_curve(q, k, v, GEOM, ranking, kept, q_pos=q_pos, k_pos=k_pos,
                                        recent=recent, sinks=sinks, per_head=per_head)  # fmt: skip
    full = _outputs(q, k, v, q_pos, k_pos)
    rank = ranking if per_head else ranking.sum(0, keepdim=True).expand_as(ranking)
    for i, count in enumerate(kept.tolist()):
        keep = select_keep(rank, keep=count, recent=recent, sinks=sinks)
        change = (_outputs(q, k, v, q_pos, k_pos, keep) - full).square().sum((1, 2, 3))
        want = (change / full.square().sum((1, 2, 3))).mean().item()
        assert curve[i].item() == pytest.approx(want, rel=1e-9, abs=1e-15), count
    assert curve[-1] == 0.0 and curve[0] > 0


def test_the_choice_is_the_fewest_tokens_within_the_target():
    curve = torch.tensor([0.5, 0.2, 0.05, 0.01, 0.0], dtype=torch.float64)
    assert estimate.choose(curve, 0.05) == 2
    assert estimate.choose(curve, 1.0) == 0
    assert estimate.choose(curve, 1e-9) == 4


def _row(kv: dict, n: int, order: EvictionOrder) -> RowPlan:
    state = RequestKvState.create(parse_kv_options(kv, n, 4096))
    state.record = {}
    return RowPlan(0, "r0", BS, state, 0, n, n, n, True, order)


@pytest.mark.parametrize("target", [0.002, 0.05, 10.0, 1e-12])
def test_a_deferred_order_scores_every_layer_then_keeps_one_count_in_all(target):
    gen = torch.Generator().manual_seed(4)
    n, layers = 100, 3
    caches = layer_cache_views(layers, 16, HKV, BS, D, "LBNHC", torch.float32)
    table = torch.zeros((1, 8), dtype=torch.int32)
    table[0, :7] = torch.randperm(15, generator=gen)[:7].int() + 1
    kv = {"kv_budget": {"max_error": target}, "kv_pipeline": "snapkv", "kv_window": 8,
          "kv_scorer": "obcache_key"}  # fmt: skip
    floor = 4 + 16 + 1  # sinks + recent + 1
    order = EvictionOrder(logical_len=n, dead_before=0, dead_after=(n - floor) // BS,
                          block_size=BS, max_error=target)  # fmt: skip
    row = _row(kv, n, order)
    plan = StepPlan(dead=(0,), rows=(row,), block_size=BS)
    plan.read_block_table = table
    data, curves = [], []
    for i, cache in enumerate(caches):
        k, v = torch.randn((2, n, HKV, D), generator=gen)
        q = torch.randn((n, HQ, D), generator=gen)
        write_slots(cache, table[0], 0, k, v)
        before = cache.clone()
        evict_after_attention(plan, f"layer{i}", q, FlashAttnKvView(cache, D), GEOM)
        assert torch.equal(cache, before), "a deferred order writes nothing in the forward"
        pipeline, scorer = row.state.pipeline, row.state.scorer
        q_pos, k_pos = torch.arange(n - 8, n), torch.arange(n)
        ranking = pipeline.prefill_scores(scorer, q[-8:], k, v, GEOM, q_pos, k_pos)
        candidates = torch.tensor([n - d * BS for d in range(order.dead_after, -1, -1)])
        curves.append(estimate.window_error_curve(q[-8:], k, v, GEOM, ranking, candidates,
                                                  q_pos=q_pos, k_pos=k_pos, recent=16,
                                                  sinks=4))  # fmt: skip
        data.append((k, ranking))
    assert row.outcome.compacted_layers == 0 and len(row.outcome.deferred) == layers
    finish_deferred(plan, layers)
    curve = torch.stack(curves).mean(0)
    index = estimate.choose(curve, target)
    dead_after, kept, est = row.outcome.chosen
    assert (dead_after, kept) == (order.dead_after - index, n - (order.dead_after - index) * BS)
    assert est == pytest.approx(float(curve[index])) and est <= target
    assert row.outcome.failure is None and row.outcome.compacted_layers == layers
    if target == 10.0:
        assert dead_after == order.dead_after  # anything goes: the floor
    if target == 1e-12:
        assert dead_after == 0 and kept == n  # nothing may go: the cache stays as it was
    for i, (k, ranking) in enumerate(data):
        keep = select_keep(ranking, keep=kept, recent=16, sinks=4)
        if dead_after:  # the kept keys now fill the logical slots [dead_after*bs, n)
            assert torch.equal(row.state.record[f"layer{i}"], keep)
            got = FlashAttnKvView(caches[i], D).gather(table[:, dead_after:], kept)[0][0]
            want = k.transpose(0, 1).gather(1, keep.unsqueeze(-1).expand(-1, -1, D))
            torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"max_error": 0}, "finite number > 0"),
        ({"max_error": True}, "a number > 0"),
        ({"max_error": 0.1, "extra": 1}, "unknown key 'extra'"),
        ({"min": 64}, r"max_error \(or max_kl\) is missing"),
        ({"max_error": 0.1, "min": 0}, "min must be an integer >= 1"),
        ("max_error:nope", "max_error: not a number"),
        ("max_error=0.1", "must be an integer >= 1"),
    ],
)
def test_bad_targets_are_refused_naming_kv_budget(value, message):
    with pytest.raises(KvOptionsError, match=message) as info:
        parse_kv_options({"kv_budget": value}, 1000)
    assert info.value.field == "kv_budget"


def test_a_target_resolves_to_its_floor_and_travels_as_scalars():
    from obcache_vllm.options import KvOptions

    opts = parse_kv_options({"kv_budget": {"max_error": 0.02}}, 1000)
    assert (opts.budget, opts.max_error, opts.requested_budget) == (21, 0.02, "max_error:0.02")
    assert KvOptions.from_wire(opts.to_wire()) == opts
    scalar = parse_kv_options({"kv_budget": "max_error:0.02,min:0.1"}, 1000)
    assert (scalar.budget, scalar.max_error) == (100, 0.02)
    assert parse_kv_options({"kv_budget": {"max_error": 0.5, "min": 300}}, 1000).budget == 300


def test_auto_starts_no_session_where_the_engine_serves_none():
    """Speculative decoding, an interleaved sliding-window model or prefix caching off: a
    first sighting compresses whole and a continuation is not served as a session."""
    request = parse_request({"kv_budget": 64, "kv_compress_at": "auto", "kv_pipeline": "tova"})
    assert resolve(request, 500).session  # a tentative session where sessions are served
    first = resolve(request, 500, sessions=False)
    assert not first.session and not first.tentative and first.compress_at is None
    follow = resolve(request, 500, auto_point=256, auto_session=True, sessions=False)
    assert not follow.session and follow.compress_at == 256


def test_a_target_takes_a_compress_point_and_a_session():
    """The target chooses its count at the point (tests/engine/test_error_target.py); its key
    for the compressed cache it leaves holds its max_error (a fixed budget of its floor at
    the same point is another cache)."""
    opts = parse_kv_options({"kv_budget": {"max_error": 0.1}, "kv_compress_at": 500}, 1000)
    assert (opts.compress_at, opts.budget, opts.max_error) == (500, 21, 0.1)
    auto = parse_kv_options({"kv_budget": {"max_error": 0.1}, "kv_compress_at": "auto"}, 1000)
    assert auto.compress_at is None and not auto.session  # never a session: no point seen
    request = parse_request({"kv_budget": {"max_error": 0.1}, "kv_compress_at": "auto"})
    followed = resolve(request, 1000, auto_point=600, auto_session=True)  # a chat's next turn
    assert not followed.session and followed.compress_at is None  # whole, not a session
    session = parse_kv_options({"kv_budget": {"max_error": 0.1}, "kv_session": True}, 1000)
    assert session.session and session.max_error == 0.1  # each turn within what is left
    decode = parse_kv_options({"kv_budget": {"max_error": 0.1}, "kv_decode": True}, 1000)
    assert decode.decode and decode.max_error == 0.1  # decode keeps the count it chose


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({"kv_pipeline": "streaming"}, "no scored queries"),
        ({"kv_pipeline": "h2o"}, "share of attention"),
        ({"kv_prefill_evict": True}, "kv_prefill_evict"),
        ({"kv_when": "pressure"}, "kv_when"),
    ],
)
def test_what_a_target_cannot_serve_is_refused(fields, why):
    with pytest.raises(KvOptionsError, match=why) as info:
        parse_kv_options({"kv_budget": {"max_error": 0.1}, **fields}, 1000)
    assert info.value.field == "kv_budget"
