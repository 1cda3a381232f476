"""The policy's selection for query-agnostic requests (default.yaml's ``query_agnostic``):
which requests get it, how it composes with a request's own fields and the other defaults,
and how it is configured and validated. Plain Python; through the real server:
tests/server/test_openai_server.py::test_a_query_agnostic_request_gets_the_shipped_selection.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from obcache_vllm import admission, cli, config

REPO = Path(__file__).resolve().parents[2]
DEFAULTS = {**config.BUILTIN_DEFAULTS, "kv_pipeline": "snapkv", "kv_window": 32,
            "kv_per_head": True, "kv_scorer": "obcache_key"}  # fmt: skip
TOVA = {"kv_pipeline": "tova", "kv_per_head": False, "kv_window": 1, "kv_scorer": "obcache_key"}


def _merged(requested: dict, agnostic: dict | None = TOVA) -> dict:
    return admission.merge_fields(DEFAULTS, requested, agnostic)


def _selection(merged: dict) -> dict:
    return {k: merged.get(k) for k in admission.SELECTION_FIELDS}


def test_a_request_with_a_compress_position_and_no_selection_gets_the_agnostic_selection():
    for point in (-96, 700, 1, 512.0):  # a whole float is the position the parser reads
        merged = _merged({"kv_budget": 0.3, "kv_compress_at": point})
        assert _selection(merged) == TOVA, point
        assert merged["kv_compress_at"] == point and merged["kv_budget"] == 0.3
        assert merged["kv_sinks"] == DEFAULTS["kv_sinks"]  # the rest: the ordinary defaults


@pytest.mark.parametrize("requested", [
    pytest.param({"kv_budget": 0.3}, id="no-compress-point"),
    pytest.param({"kv_budget": 0.3, "kv_compress_at": "auto"}, id="auto"),
    pytest.param({"kv_budget": 0.3, "kv_compress_at": None}, id="null-point"),
    pytest.param({"kv_budget": 0.3, "kv_compress_at": True}, id="a-bool-is-not-a-position"),
    pytest.param({"kv_budget": 0.3, "kv_compress_at": 0}, id="refused-anyway"),
])  # fmt: skip
def test_other_requests_get_the_ordinary_selection(requested):
    assert _selection(_merged(requested)) == {k: DEFAULTS[k] for k in admission.SELECTION_FIELDS}


@pytest.mark.parametrize("field, value", [("kv_scorer", "attn"), ("kv_pipeline", "h2o"),
                                          ("kv_window", 8), ("kv_per_head", True)])  # fmt: skip
def test_naming_any_selection_field_gives_the_ordinary_defaults_for_the_rest(field, value):
    merged = _merged({"kv_budget": 0.3, "kv_compress_at": -96, field: value})
    want = {**{k: DEFAULTS[k] for k in admission.SELECTION_FIELDS}, field: value}
    assert _selection(merged) == want


def test_no_budget_stays_stock_and_no_agnostic_selection_changes_nothing():
    assert _merged({"kv_compress_at": -96}) == {"kv_compress_at": -96}
    plain = admission.merge_fields(DEFAULTS, {"kv_budget": 64, "kv_compress_at": -96})
    assert _merged({"kv_budget": 64, "kv_compress_at": -96}, None) == plain
    assert _selection(plain)["kv_pipeline"] == "snapkv"


def test_the_policys_own_compress_point_does_not_make_a_request_query_agnostic():
    """The policy's ``compress_at: auto`` (a default budget on a client that asked for
    nothing) is decided later, from what the server has seen: the ordinary selection."""
    policy = admission.Policy({**DEFAULTS, "kv_budget": 0.25}, query_agnostic=TOVA)
    merged = admission.policy_fields(policy, {})
    assert merged["kv_compress_at"] == "auto" and merged["kv_pipeline"] == "snapkv"
    own = admission.policy_fields(policy, {"kv_compress_at": -64})
    assert _selection(own) == TOVA and own["kv_budget"] == 0.25


def test_parse_through_the_policy_gives_the_agnostic_selection():
    policy = admission.Policy(DEFAULTS, query_agnostic=TOVA)
    got = admission.parse({"kv_budget": 0.3, "kv_compress_at": -96}, policy).request
    assert (got.pipeline, got.per_head, got.window, got.scorer) == ("tova", False, 1, "obcache_key")
    plain = admission.parse({"kv_budget": 0.3}, policy).request
    assert (plain.pipeline, plain.per_head, plain.window) == ("snapkv", True, 32)


def test_the_shipped_file_ships_a_selection_or_null_and_loads():
    shipped = yaml.safe_load(config.PACKAGED_CONFIG.read_text())
    policy = config.load_policy({})
    assert policy.query_agnostic == shipped[admission.QUERY_AGNOSTIC_KEY]
    assert admission.QUERY_AGNOSTIC_KEY not in policy.defaults  # a policy key, not a field
    assert policy.document()[admission.QUERY_AGNOSTIC_KEY] == policy.query_agnostic


def test_file_environment_and_flag_set_it(tmp_path: Path):
    path = tmp_path / "kv.yaml"
    path.write_text("query_agnostic: {kv_pipeline: tova, kv_per_head: false, kv_window: 1}\n")
    env = {config.CONFIG_ENV: str(path)}
    assert config.load_policy(env).query_agnostic == {"kv_pipeline": "tova", "kv_per_head": False,
                                                      "kv_window": 1}  # fmt: skip
    assert config.load_policy({**env, config.QUERY_AGNOSTIC_ENV: "null"}).query_agnostic is None
    assert config.load_policy({**env, config.QUERY_AGNOSTIC_ENV: ""}).query_agnostic is None
    got = config.load_policy({**env, config.QUERY_AGNOSTIC_ENV: "{kv_pipeline: streaming}"})
    assert got.query_agnostic == {"kv_pipeline": "streaming"}
    rest, flag_env = cli.split_policy_args(["--default-query-agnostic", "null", "--port", "1"])
    assert rest == ["--port", "1"] and flag_env == {config.QUERY_AGNOSTIC_ENV: "null"}


@pytest.mark.parametrize("yaml_text, needle", [
    pytest.param("query_agnostic: tova\n", "must be a mapping", id="not-a-mapping"),
    pytest.param("query_agnostic: {}\n", "must be a mapping", id="empty"),
    pytest.param("query_agnostic: {kv_budget: 64}\n", "'kv_budget' is not a selection field",
                 id="not-a-selection-field"),
    pytest.param("query_agnostic: {kv_pipeline: magic}\n", "query_agnostic: kv_pipeline",
                 id="bad-value"),
    pytest.param("query_agnostic: {kv_window: 0}\n", "query_agnostic: kv_window",
                 id="bad-window"),
])  # fmt: skip
def test_a_bad_selection_stops_the_server_naming_the_key(tmp_path: Path, yaml_text, needle):
    path = tmp_path / "kv.yaml"
    path.write_text(yaml_text)
    with pytest.raises(config.ConfigError, match=needle):
        config.load_policy({config.CONFIG_ENV: str(path)})
    with pytest.raises(config.ConfigError, match=config.QUERY_AGNOSTIC_ENV):
        config.load_policy({config.QUERY_AGNOSTIC_ENV: "{kv_scorer: magic}"})


def test_a_selection_is_not_blamed_for_what_a_compress_point_is_refused_with(tmp_path: Path):
    """Default ``kv_when: pressure`` (refused with any compress point) and a valid selection:
    the server starts; such a request is refused for kv_when, as without the selection."""
    path = tmp_path / "kv.yaml"
    path.write_text("kv_budget: 0.25\nkv_when: pressure\nquery_agnostic: {kv_pipeline: tova}\n")
    policy = config.load_policy({config.CONFIG_ENV: str(path)})
    assert policy.query_agnostic == {"kv_pipeline": "tova"}


@pytest.mark.parametrize("env, needle", [
    pytest.param({"OBCACHE_KV_BUDGET": '{"max_error": 0.1}',
                  config.QUERY_AGNOSTIC_ENV: "{kv_pipeline: streaming}"},
                 "no scored queries", id="error-target-default-and-no-scored-queries"),
    pytest.param({"OBCACHE_KV_BUDGET": "0.3", "OBCACHE_KV_PREFILL_EVICT": "true",
                  config.QUERY_AGNOSTIC_ENV: "{kv_pipeline: adakv}"},
                 "kv_prefill_evict", id="prefill-chunks-default-and-adakv"),
])  # fmt: skip
def test_a_selection_the_other_defaults_refuse_stops_the_server(env, needle):
    """Refused at start where the other defaults serve a query-agnostic request and the
    selection over them would not (each request would get a 400 instead)."""
    why = f"query_agnostic: with the other defaults.*{needle}"
    with pytest.raises(config.ConfigError, match=why):
        config.load_policy(env)


def test_a_selection_set_by_variable_or_flag_turns_the_files_block_off():
    """The operator who chooses the selection by ``OBCACHE_KV_*`` (or its flag) gets it for
    every request, unless they also set the query-agnostic one."""
    assert config.load_policy({"OBCACHE_KV_PIPELINE": "h2o"}).query_agnostic is None
    both = {"OBCACHE_KV_PIPELINE": "h2o", config.QUERY_AGNOSTIC_ENV: "{kv_pipeline: tova}"}
    assert config.load_policy(both).query_agnostic == {"kv_pipeline": "tova"}
    assert config.load_policy({"OBCACHE_KV_BUDGET": "0.3"}).query_agnostic is not None
