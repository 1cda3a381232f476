"""A model's own selection (default.yaml's ``models``): which server takes it, what overrides
it, how it is validated, and that the shipped file holds each model's recorded winner.
Plain Python; through a real server on Gemma 3 270M:
tests/server/test_model_defaults_http.py.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import yaml

from obcache_vllm import admission, config

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("choose_defaults",
                                               ROOT / "scripts" / "choose_defaults.py")
choose_defaults = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(choose_defaults)

TOVA = {"kv_pipeline": "tova", "kv_per_head": False, "kv_window": 1, "kv_scorer": "attn"}
FILE = ("kv_pipeline: snapkv\nkv_window: 32\nkv_per_head: true\nkv_scorer: dropkv\n"
        f"models: {json.dumps({'toy-1b': TOVA})}\n")  # fmt: skip


def _selection(policy) -> dict:
    return {k: policy.defaults[k] for k in admission.SELECTION_FIELDS}


@pytest.fixture
def env(tmp_path: Path) -> dict:
    path = tmp_path / "kv.yaml"
    path.write_text(FILE)
    return {config.CONFIG_ENV: str(path)}


def test_a_server_of_a_named_model_takes_its_selection_and_others_the_files(env):
    """By the model's last part (a path, a trailing slash or a hub id alike); the rest of the
    policy, the query-agnostic selection included, is the file's for every model."""
    for model in ("/models/toy-1b", "/models/toy-1b/", "org/toy-1b", "toy-1b"):
        assert _selection(config.load_policy(env, model=model)) == TOVA, model
    files = {"kv_pipeline": "snapkv", "kv_window": 32, "kv_per_head": True, "kv_scorer": "dropkv"}
    for model in (None, "/models/toy-1b-instruct", "/models/other"):
        assert _selection(config.load_policy(env, model=model)) == files, model
    mine, other = config.load_policy(env, model="toy-1b"), config.load_policy(env, model="x")
    assert mine.query_agnostic == other.query_agnostic
    assert {k: v for k, v in mine.defaults.items() if k not in admission.SELECTION_FIELDS} == \
        {k: v for k, v in other.defaults.items() if k not in admission.SELECTION_FIELDS}
    assert config.MODELS_KEY not in mine.defaults  # a policy key, not a request field
    assert config.MODELS_KEY not in config.load_defaults(env)


def test_a_selection_field_set_by_variable_or_flag_applies_to_every_model(env):
    """The operator's choice for this server wins over the file's per-model one, whole (a
    selection is measured whole): the model's fields are not mixed into it."""
    got = config.load_policy({**env, "OBCACHE_KV_SCORER": "obcache_key"}, model="toy-1b")
    assert _selection(got) == {"kv_pipeline": "snapkv", "kv_window": 32, "kv_per_head": True,
                               "kv_scorer": "obcache_key"}  # fmt: skip
    # A field outside the selection leaves the model's selection in place.
    got = config.load_policy({**env, "OBCACHE_KV_BUDGET": "0.25"}, model="toy-1b")
    assert _selection(got) == TOVA and got.defaults["kv_budget"] == 0.25


@pytest.mark.parametrize("text, needle", [
    pytest.param("models: [toy]\n", "models must be a mapping", id="not-a-mapping"),
    pytest.param("models: {toy: tova}\n", "'toy' must be a mapping", id="not-a-selection"),
    pytest.param("models: {toy: {}}\n", "'toy' must be a mapping", id="empty"),
    pytest.param("models: {toy: {kv_budget: 3}}\n", "'toy': 'kv_budget' is not a selection",
                 id="not-a-selection-field"),
    pytest.param("models: {toy: {kv_pipeline: magic}}\n", "'toy': with the other defaults",
                 id="bad-value"),
    pytest.param("models: {org/toy: {kv_pipeline: tova}}\n", "last part", id="a-path"),
])  # fmt: skip
def test_a_bad_per_model_selection_stops_the_server_naming_the_key(tmp_path, text, needle):
    path = tmp_path / "kv.yaml"
    path.write_text(text)
    with pytest.raises(config.ConfigError, match=needle):
        config.load_policy({config.CONFIG_ENV: str(path)})


def test_the_shipped_file_holds_each_models_recorded_winner():
    """Every model with a rule of its own (``configs/choose_defaults-<model>.yaml``) and a
    recorded decision ships that decision's winner in ``models``, field for field, and the
    block names it; the shipped file loads for each."""
    shipped = choose_defaults.shipped_models()
    rules = sorted(ROOT.glob("configs/choose_defaults-*.yaml"))
    assert rules
    for path in rules:
        rule = choose_defaults.load_rule(path)
        out = ROOT / "results" / f"choose-defaults-{rule['model']}"
        decision = json.loads((out / "decision.json").read_text())
        if decision["winner"] is None:
            continue  # insufficient evidence: nothing written
        assert shipped[rule["model"]] == {k: v for k, v in rule["candidates"][
            decision["winner"]].items() if k in choose_defaults.SELECTION}
        assert choose_defaults.shipped_for_model(rule["model"]) == decision["winner"]
        policy = config.load_policy({}, model=f"/anywhere/{rule['model']}")
        assert {k: policy.defaults[k] for k in shipped[rule["model"]]} == shipped[rule["model"]]
    assert set(shipped) <= {choose_defaults.load_rule(p)["model"] for p in rules}


def test_a_winner_is_written_for_its_model_beside_the_others(tmp_path):
    """``--write`` with a rule for another model: its entry in the per-model block (the file
    stays valid YAML the server loads), other models' entries and every other block as they
    were; a second run for the same model replaces its entry."""
    shipped = tmp_path / "default.yaml"
    shipped.write_text(config.PACKAGED_CONFIG.read_text())
    before = yaml.safe_load(shipped.read_text())
    choose_defaults.write_model(TOVA, "tova-shared-w1-attn", "toy-1b", "results/x", shipped)
    choose_defaults.write_model({**TOVA, "kv_scorer": "obcache_key"}, "tova-shared-w1-obcache_key",
                                "alpha", "results/y", shipped)  # fmt: skip
    choose_defaults.write_model({"kv_pipeline": "snapkv", "kv_window": 32, "kv_per_head": True,
                                 "kv_scorer": "dropkv"}, "snapkv-w32-dropkv", "toy-1b",
                                "results/x", shipped)  # fmt: skip
    after = yaml.safe_load(shipped.read_text())
    assert {k: v for k, v in after.items() if k != "models"} == \
        {k: v for k, v in before.items() if k != "models"}
    assert after["models"] == {
        **before["models"],  # the shipped entries stay
        "alpha": {**TOVA, "kv_scorer": "obcache_key"},
        "toy-1b": {"kv_pipeline": "snapkv", "kv_window": 32, "kv_per_head": True,
                   "kv_scorer": "dropkv"}}  # fmt: skip
    assert choose_defaults.shipped_for_model("toy-1b", shipped) == "snapkv-w32-dropkv"
    assert choose_defaults.shipped_for_model("alpha", shipped) == "tova-shared-w1-obcache_key"
    for model in before["models"]:
        assert choose_defaults.shipped_for_model(model, shipped) == \
            choose_defaults.shipped_for_model(model)
    got = config.load_policy({config.CONFIG_ENV: str(shipped)}, model="/m/alpha")
    assert got.defaults["kv_pipeline"] == "tova"


def test_the_server_learns_its_model_when_vllm_registers_its_routes(env, monkeypatch):
    """The wrapped ``register_api_routers`` (the pinned seam) tells the policy the served model
    before any request: the policy loaded at install (no model yet) is replaced by the model's,
    and ``GET /v1/obcache/config`` names it."""
    from types import SimpleNamespace

    from obcache_vllm.vllm_ext.frontend import server

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(server, "_served_model", None)
    server.reset_defaults()
    try:
        assert server.server_policy().defaults["kv_pipeline"] == "snapkv"  # as at install
        routes = []
        app = SimpleNamespace(add_api_route=lambda *a, **k: routes.append(a[0]))
        wrapped = server._wrap_register_api_routers(lambda args, app, *rest: None)
        wrapped(SimpleNamespace(model="/models/toy-1b/"), app, ["generate"], None)
        assert _selection(server.server_policy()) == TOVA
        assert server.config_document()["policy"]["model"] == "toy-1b"
        assert routes == [server.CONFIG_ROUTE]
    finally:
        server.set_served_model(None)
        server.reset_defaults()
