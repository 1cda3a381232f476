"""KL targets (``kv_budget: {"max_kl": nats}``) without a model: the field, what it refuses,
the shipped calibration against the measurement that made it, and the worker's choice.

On the real engine and model: ``tests/engine/test_error_target.py`` (the choice is the
calibration's on the curves the layers computed); the calibration's coverage on held-out prompts
is measured by ``scripts/error_predictor_eval.py`` (results/error-predictor).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from obcache_vllm.admission import kl_calibration_refusal, parse_kv_options, parse_request
from obcache_vllm.eviction.layer import evict_after_attention, finish_deferred
from obcache_vllm.eviction.messages import EvictionOrder
from obcache_vllm.eviction.step import RequestKvState, RowPlan, StepPlan
from obcache_vllm.evidence.kernel_checks.paged import write_slots
from obcache_vllm.options import ErrorTarget, KvOptions, KvOptionsError
from obcache_vllm.scoring import HeadGeometry, estimate, select_keep
from obcache_vllm.scoring.calibration import CALIBRATIONS, KlCalibration, for_model
from obcache_vllm.vllm_ext.worker.backends.flash_attn_layout import (
    FlashAttnKvView,
    layer_cache_views,
)

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("error_predictor_eval",
                                               ROOT / "scripts" / "error_predictor_eval.py")
ep = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ep)

MODEL = "SmolLM2-135M-Instruct"
CALIBRATED = {"kv_pipeline": "snapkv", "kv_window": 32, "kv_per_head": True,
              "kv_scorer": "obcache_key"}  # fmt: skip


# -- the field ------------------------------------------------------------------------------
@pytest.mark.parametrize("raw", [{"max_kl": 0.2}, "max_kl:0.2", {"max_kl": 0.2, "min": 64},
                                 "max_kl:0.2,min:64"])  # fmt: skip
def test_a_kl_target_parses_and_resolves_in_nats(raw):
    request = parse_request({"kv_budget": raw, **CALIBRATED})
    assert isinstance(request.budget, ErrorTarget) and request.budget.kl
    assert request.budget.max_error == 0.2
    assert request.budget.scalar().startswith("max_kl:0.2")
    options = parse_kv_options({"kv_budget": raw, **CALIBRATED}, 1000, 4096)
    assert options.kl_target and options.max_error == 0.2
    assert KvOptions.from_wire(options.to_wire()) == options
    plain = parse_kv_options({"kv_budget": {"max_error": 0.2}, **CALIBRATED}, 1000, 4096)
    assert not plain.kl_target and plain.max_error == 0.2


@pytest.mark.parametrize("raw, says", [
    ({"max_kl": 0.2, "max_error": 0.1}, "together"),
    ({"max_kl": -1}, "max_kl must be a finite number > 0"),
    ({"max_kl": "x"}, "max_kl must be a number > 0"),
    ({"min": 64}, "max_error (or max_kl) is missing"),
])  # fmt: skip
def test_a_bad_kl_target_names_the_field(raw, says):
    with pytest.raises(KvOptionsError, match="kv_budget") as info:
        parse_request({"kv_budget": raw})
    assert says in str(info.value)


@pytest.mark.parametrize("extra, says", [
    ({"kv_pipeline": "h2o", "kv_scorer": "attn"}, "no window of queries"),
    ({"kv_compress_at": -96}, "kv_compress_at"),
    ({"kv_decode": True}, "kv_decode"),
    ({"kv_session": True}, "kv_session"),
])  # fmt: skip
def test_a_kl_target_refuses_what_its_calibration_did_not_measure(extra, says):
    with pytest.raises(KvOptionsError, match="kv_budget") as info:
        parse_request({"kv_budget": {"max_kl": 0.2}, **CALIBRATED, **extra})
    assert "a KL target" in str(info.value) and says in str(info.value)
    # the same options with an error target are served
    parse_request({"kv_budget": {"max_error": 0.02}, **CALIBRATED, **extra})


def _engine(model: str, layers: int):
    return SimpleNamespace(parallel_config=None,
                           model_config=SimpleNamespace(model=model,
                                                        get_num_layers=lambda _pc: layers))


def test_the_engine_refuses_a_kl_target_without_its_models_calibration():
    options = parse_kv_options({"kv_budget": {"max_kl": 0.2}, **CALIBRATED}, 1000, 4096)
    assert kl_calibration_refusal(_engine(f"/models/{MODEL}", 30), options) is None
    assert kl_calibration_refusal(_engine(f"/models/{MODEL}/", 30), options) is None
    for engine in (_engine("/models/gemma-3-270m", 18), _engine(f"/x/{MODEL}", 24)):
        field, why = kl_calibration_refusal(engine, options)
        assert field == "kv_budget" and "needs a calibration" in why and MODEL in why
    for name, value in (("window", 64), ("scorer", "attn"), ("per_head", False),
                        ("pipeline", "tova")):  # fmt: skip
        other = parse_kv_options({"kv_budget": {"max_kl": 0.2}, **CALIBRATED,
                                  f"kv_{name}": value}, 1000, 4096)  # fmt: skip
        field, why = kl_calibration_refusal(_engine(f"/models/{MODEL}", 30), other)
        assert field == f"kv_{name}" and "measured with" in why, why


def test_a_kl_target_naming_no_selection_gets_its_calibrations_not_the_servers_defaults():
    """The server's shipped selection is chosen for accuracy (``make choose-defaults``) and
    need not be the one the KL calibration was measured with: a ``max_kl`` request that names
    no selection field is served with the calibration's selection (its predicted KL holds for
    that one only); naming any selection field keeps the request's own (refused where it is
    not the calibration's); an error target in the estimate's unit and a plain budget keep
    the server's defaults; a model without a calibration is left to its refusal."""
    from obcache_vllm.admission import Policy, kl_selection, parse

    policy = Policy({"kv_budget": None, "kv_scorer": "dropkv", "kv_pipeline": "snapkv",
                     "kv_window": 32, "kv_per_head": True})  # fmt: skip
    engine = _engine(f"/models/{MODEL}", 30)
    kl = parse({"kv_budget": {"max_kl": 0.2}}, policy)
    assert not kl.selection_named and kl.request.scorer == "dropkv"
    served = kl_selection(engine, kl.request)
    assert (served.pipeline, served.window, served.per_head, served.scorer) == (
        "snapkv", 32, True, "obcache_key")
    assert served.budget == kl.request.budget
    options = parse_kv_options({"kv_budget": {"max_kl": 0.2}, **CALIBRATED}, 1000, 4096)
    assert kl_calibration_refusal(engine, options) is None
    named = parse({"kv_budget": {"max_kl": 0.2}, "kv_window": 32}, policy)
    assert named.selection_named  # admit() keeps it: refused, naming kv_scorer
    for budget in ({"max_error": 0.1}, 0.25):
        other = parse({"kv_budget": budget}, policy).request
        assert kl_selection(engine, other) is other
    assert kl_selection(_engine("/models/gemma-3-270m", 18), kl.request) is kl.request


# -- the shipped calibration ----------------------------------------------------------------
def test_the_shipped_calibration_is_the_fit_the_report_measured():
    """The file is exactly ``calibration()`` of the committed measurement and analysis (the
    ``fit`` predictor, its cross-fitted map): what results/error-predictor reports on held-out
    prompts is what ships."""
    res = json.loads((ROOT / "results/error-predictor/error_predictor.json").read_text())
    an = json.loads((ROOT / "results/error-predictor/analysis.json").read_text())
    shipped = json.loads((CALIBRATIONS / f"{MODEL}.json").read_text())
    made = ep.calibration(res, an, (ROOT / "results/error-predictor").resolve())
    assert shipped == made
    assert for_model(f"/anywhere/{MODEL}", 30) == KlCalibration.from_json(shipped)
    assert for_model(f"/anywhere/{MODEL}", 24) is None and for_model("/x/other", 30) is None


def test_the_calibration_predicts_what_the_evaluation_predicted():
    """``nats`` on tensors equals the evaluation's own predictor and map (scalar Python, per
    prompt) on errors spanning what layers report, zeros (a layer that lost nothing) included."""
    cal = for_model(MODEL, 30)
    an = json.loads((ROOT / "results/error-predictor/analysis.json").read_text())
    pred = ep.predictor("fit", an["ridge"])
    mapping = an["predictors"]["fit"]["map"]
    gen = torch.Generator().manual_seed(0)
    curves = torch.exp(torch.empty((30, 40), dtype=torch.float64).uniform_(-14, 0, generator=gen))
    curves[:, -1] = 0.0  # the candidate that keeps everything
    curves[3, 5] = 0.0
    got = cal.nats(curves)
    want = [ep.in_nats(mapping, pred(curves[:, c].tolist())) for c in range(curves.shape[1])]
    assert got.tolist() == pytest.approx(want, rel=1e-9)
    with pytest.raises(ValueError, match="30-layer"):
        cal.nats(curves[:29])


# -- the worker's choice --------------------------------------------------------------------
BS, HQ, HKV, D = 16, 4, 2, 32
GEOM = HeadGeometry(HQ, HKV, D)


def _deferred_row(target: float, layers: int, n: int = 100):
    gen = torch.Generator().manual_seed(5)
    caches = layer_cache_views(layers, 16, HKV, BS, D, "LBNHC", torch.float32)
    table = torch.zeros((1, 8), dtype=torch.int32)
    table[0, :7] = torch.randperm(15, generator=gen)[:7].int() + 1
    kv = {"kv_budget": {"max_kl": target}, "kv_pipeline": "snapkv", "kv_window": 8,
          "kv_scorer": "obcache_key"}  # fmt: skip
    order = EvictionOrder(logical_len=n, dead_before=0, dead_after=(n - 21) // BS,
                          block_size=BS, max_error=target)  # fmt: skip
    state = RequestKvState.create(parse_kv_options(kv, n, 4096))
    state.record = {}
    row = RowPlan(0, "r0", BS, state, 0, n, n, n, True, order)
    plan = StepPlan(dead=(0,), rows=(row,), block_size=BS)
    plan.read_block_table = table
    rankings = []
    for i, cache in enumerate(caches):
        k, v = torch.randn((2, n, HKV, D), generator=gen)
        q = torch.randn((n, HQ, D), generator=gen)
        write_slots(cache, table[0], 0, k, v)
        evict_after_attention(plan, f"layer{i}", q, FlashAttnKvView(cache, D), GEOM)
        rankings.append(row.state.pipeline.prefill_scores(
            row.state.scorer, q[-8:], k, v, GEOM, torch.arange(n - 8, n), torch.arange(n)))
    return plan, row, rankings, n


@pytest.mark.parametrize("target", [1e-6, 0.3, 1e6])
def test_a_kl_target_keeps_the_fewest_tokens_the_calibration_allows(target):
    """The count is the first candidate whose predicted nats are within the target, predicted
    from every layer's curve together (not their mean); each layer then keeps that many."""
    layers = 3
    cal = KlCalibration(model="toy", num_layers=layers, intercept=0.5, weights=(0.2, -0.1, 0.6),
                        map_a=-0.3, map_b=0.9, margin=0.4,
                        setting={"pipeline": "snapkv", "window": 8, "per_head": True,
                                 "scorer": "obcache_key"})  # fmt: skip
    plan, row, rankings, n = _deferred_row(target, layers)
    curves = torch.stack([d.curve for d in row.outcome.deferred.values()])
    finish_deferred(plan, layers, cal)
    nats = cal.nats(curves)
    index = estimate.choose(nats, target)
    dead_after, kept, est = row.outcome.chosen
    assert dead_after == row.order.dead_after - index and kept == n - dead_after * BS
    assert est == pytest.approx(float(nats[index]))
    assert row.outcome.failure is None and row.outcome.compacted_layers == layers
    if target == 1e6:
        assert dead_after == row.order.dead_after
    if target == 1e-6:
        assert dead_after == 0
    for i, ranking in enumerate(rankings):
        if dead_after:
            keep = select_keep(ranking, keep=kept, recent=16, sinks=4)
            assert torch.equal(row.state.record[f"layer{i}"], keep)


def test_a_kl_order_without_a_calibration_is_a_contained_fault():
    plan, row, _, _ = _deferred_row(0.3, 2)
    finish_deferred(plan, 2, None)
    assert row.outcome.failure is not None and "calibration" in row.outcome.failure[2]
    assert row.outcome.compacted_layers == 0 and row.outcome.chosen is None
