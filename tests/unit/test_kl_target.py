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
from obcache_vllm.scoring.calibration import (
    CALIBRATIONS,
    KlCalibration,
    closest,
    file_name,
    for_model,
)
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
# Each shipped calibration of the default model and the measurement it was written from.
SHIPPED = {"obcache_key": "results/error-predictor", "dropkv": "results/error-predictor-dropkv"}


def _setting(scorer: str) -> dict:
    return {"pipeline": "snapkv", "window": 32, "per_head": True, "scorer": scorer}


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
        assert all(f'kv_scorer "{scorer}"' in why for scorer in SHIPPED), why
    dropkv = parse_kv_options({"kv_budget": {"max_kl": 0.2}, **CALIBRATED,
                               "kv_scorer": "dropkv"}, 1000, 4096)  # fmt: skip
    assert kl_calibration_refusal(_engine(f"/models/{MODEL}", 30), dropkv) is None


def test_a_kl_target_naming_no_selection_gets_a_calibrated_selection():
    """A ``max_kl`` request that names no selection field is served with a selection its
    model was calibrated with (its predicted KL holds for those only): the server's shipped
    selection (``make choose-defaults``) where a calibration was measured with it, else the
    calibration sharing most of the defaults' fields (offline: the options' own defaults,
    snapkv window 64 per head ``obcache_key``, get the ``obcache_key`` calibration's window
    32). Naming any selection field keeps the request's own (refused where no calibration
    was measured with it); an error target in the estimate's unit and a plain budget keep the
    server's defaults; a model without a calibration is left to its refusal."""
    from obcache_vllm.admission import Policy, kl_selection, parse, parse_request

    def selection(request):
        return (request.pipeline, request.window, request.per_head, request.scorer)

    engine = _engine(f"/models/{MODEL}", 30)
    shipped = {"kv_budget": None, "kv_scorer": "dropkv", "kv_pipeline": "snapkv",
               "kv_window": 32, "kv_per_head": True}  # fmt: skip
    kl = parse({"kv_budget": {"max_kl": 0.2}}, Policy(shipped))
    assert not kl.selection_named
    assert selection(kl_selection(engine, kl.request)) == ("snapkv", 32, True, "dropkv")
    # a server shipping an uncalibrated selection: the closest calibration's
    tova = parse({"kv_budget": {"max_kl": 0.2}},
                 Policy({**shipped, "kv_pipeline": "tova", "kv_per_head": False,
                         "kv_window": 1, "kv_scorer": "obcache_key"}))  # fmt: skip
    served = kl_selection(engine, tova.request)
    assert selection(served) == ("snapkv", 32, True, "obcache_key")
    assert served.budget == tova.request.budget
    offline = parse_request({"kv_budget": {"max_kl": 0.2}})
    assert selection(offline) == ("snapkv", 64, True, "obcache_key")
    assert selection(kl_selection(engine, offline)) == ("snapkv", 32, True, "obcache_key")
    named = parse({"kv_budget": {"max_kl": 0.2}, "kv_window": 64}, Policy(shipped))
    assert named.selection_named  # admit() keeps it: refused, naming kv_window
    for budget in ({"max_error": 0.1}, 0.25):
        other = parse({"kv_budget": budget}, Policy(shipped)).request
        assert kl_selection(engine, other) is other
    assert kl_selection(_engine("/models/gemma-3-270m", 18), kl.request) is kl.request


def test_the_closest_calibration_shares_most_fields_and_the_first_of_equals_wins():
    tova = {**_setting("attn"), "pipeline": "tova", "window": 1}
    cals = tuple(KlCalibration(model="toy", num_layers=1, intercept=0.0, weights=(1.0,),
                               map_a=0.0, map_b=1.0, margin=0.0, setting=setting)
                 for setting in (_setting("dropkv"), _setting("obcache_key"), tova))  # fmt: skip
    request = SimpleNamespace(pipeline="tova", window=1, per_head=True, scorer="attn")
    assert closest(cals, request) is cals[2]
    request = SimpleNamespace(pipeline="snapkv", window=64, per_head=True, scorer="attn")
    assert closest(cals, request) is cals[0]  # 2 fields each with the first two: the first
    assert closest((), request) is None
    assert file_name("/m/toy", _setting("dropkv")) == "toy@snapkv-w32-dropkv.json"
    assert file_name("toy", {**_setting("attn"), "per_head": False}) == (
        "toy@snapkv-w32-shared-attn.json")


# -- the shipped calibration ----------------------------------------------------------------
@pytest.mark.parametrize("scorer", SHIPPED)
def test_the_shipped_calibration_is_the_fit_the_report_measured(scorer):
    """Each file is exactly ``calibration()`` of the committed measurement and analysis (the
    ``fit`` predictor, its cross-fitted map), under the name ``--write-calibration`` gives
    it: what its results directory reports on held-out prompts is what ships."""
    results = ROOT / SHIPPED[scorer]
    res = json.loads((results / "error_predictor.json").read_text())
    an = json.loads((results / "analysis.json").read_text())
    made = ep.calibration(res, an, results.resolve())
    assert made["setting"] == _setting(scorer)
    shipped = json.loads((CALIBRATIONS / file_name(MODEL, made["setting"])).read_text())
    assert shipped == made
    found = for_model(f"/anywhere/{MODEL}", 30)
    assert KlCalibration.from_json(shipped) in found
    assert len(found) == len(SHIPPED) == len(list(CALIBRATIONS.glob(f"{MODEL}@*.json")))
    assert for_model(f"/anywhere/{MODEL}", 24) == () and for_model("/x/other", 30) == ()


@pytest.mark.parametrize("scorer", SHIPPED)
def test_the_calibration_predicts_what_the_evaluation_predicted(scorer):
    """``nats`` on tensors equals the evaluation's own predictor and map (scalar Python, per
    prompt) on errors spanning what layers report, zeros (a layer that lost nothing) included."""
    (cal,) = [c for c in for_model(MODEL, 30) if c.setting == _setting(scorer)]
    an = json.loads((ROOT / SHIPPED[scorer] / "analysis.json").read_text())
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
    from every layer's curve together (not their mean) by the calibration measured with the
    row's selection (not another of the model's); each layer then keeps that many."""
    layers = 3
    cal = KlCalibration(model="toy", num_layers=layers, intercept=0.5, weights=(0.2, -0.1, 0.6),
                        map_a=-0.3, map_b=0.9, margin=0.4,
                        setting={"pipeline": "snapkv", "window": 8, "per_head": True,
                                 "scorer": "obcache_key"})  # fmt: skip
    # another selection's calibration, first: it would choose differently
    other = KlCalibration(model="toy", num_layers=layers, intercept=-3.0, weights=(0.5, 0.5, 0.5),
                          map_a=-2.0, map_b=1.0, margin=0.0,
                          setting={**cal.setting, "scorer": "dropkv"})  # fmt: skip
    plan, row, rankings, n = _deferred_row(target, layers)
    curves = torch.stack([d.curve for d in row.outcome.deferred.values()])
    finish_deferred(plan, layers, (other, cal))
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


@pytest.mark.parametrize("scorer", [None, "dropkv"])
def test_a_kl_order_without_a_calibration_of_its_selection_is_a_contained_fault(scorer):
    """None at all, or only another selection's (admission refuses both; a worker that met
    one anyway must not predict with the wrong calibration)."""
    calibrations = () if scorer is None else (KlCalibration(
        model="toy", num_layers=2, intercept=0.0, weights=(1.0, 1.0), map_a=0.0, map_b=1.0,
        margin=0.0, setting={"pipeline": "snapkv", "window": 8, "per_head": True,
                             "scorer": scorer}),)  # fmt: skip
    plan, row, _, _ = _deferred_row(0.3, 2)
    finish_deferred(plan, 2, calibrations)
    assert row.outcome.failure is not None and "calibration" in row.outcome.failure[2]
    assert row.outcome.compacted_layers == 0 and row.outcome.chosen is None


@pytest.mark.parametrize("scorer", SHIPPED)
def test_the_shipped_map_is_the_committed_measurements_raised_for_the_choice(scorer):
    """The committed analysis's ``fit`` map (what ships) is the one the evaluation's own code
    makes from the committed measurement: the out-of-fold map whose margin was raised until the
    choice covers 9 in 10 fitting prompts at every target, not the residual quantile."""
    results = ROOT / SHIPPED[scorer]
    res = json.loads((results / "error_predictor.json").read_text())
    mapping = ep._cross_fitted_map(ep.points(res, ep._split(res)[0]), res["kl_targets"])
    committed = json.loads((results / "analysis.json").read_text())["predictors"]["fit"]["map"]
    assert mapping == pytest.approx(committed, rel=1e-9)
    assert mapping["margin"] > mapping["residual_margin"]


def test_the_margin_is_raised_until_each_targets_choice_covers_the_fitting_prompts():
    """Made-up curves where the map is exact on every point but the count each prompt would be
    chosen at: the residuals' quantile covers 9 in 10 points, a target's choice lands on the
    under-stated count and misses; the raised margin leaves 9 in 10 prompts within every
    target, and nothing is raised without targets."""
    train = []
    for i in range(20):
        for kept in range(1, 11):
            err = 10.0 ** (-kept / 2)
            kl = err * (8.0 if kept == 6 and i < 15 else 1.0)  # under-stated at one count
            train.append({"name": f"p{i}", "kept": kept, "fraction": kept / 10, "kl": kl,
                          "errors": [err]})  # fmt: skip
    pred = lambda e: e[0]  # noqa: E731
    targets = [1.5e-3]  # between the counts 6 (1e-3) and 5 (3.2e-3): chooses 6 unraised
    plain = ep.kl_map(train, pred)
    assert plain["margin"] == plain["residual_margin"]
    by_prompt = ep._by(train, lambda p: p["name"])
    assert ep.covered(by_prompt, plain, pred, targets[0]) < ep.COVER
    raised = ep.kl_map(train, pred, targets)
    assert raised["residual_margin"] == plain["margin"] < raised["margin"]
    assert ep.covered(by_prompt, raised, pred, targets[0]) >= ep.COVER
    lower = {**raised, "margin": raised["margin"] - 0.05}
    assert ep.covered(by_prompt, lower, pred, targets[0]) < ep.COVER  # the least that covers
