"""Server-wide kv_* defaults (YAML + environment) and the server's request-field plumbing.

Pure Python: obcache_vllm.config and the vLLM-free helpers of obcache_vllm.vllm_ext.frontend.server.
The same behaviour through the real server: tests/server/test_openai_server.py.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from obcache_vllm import admission, cli, config, options
from obcache_vllm.vllm_ext.frontend import server

REPO = Path(__file__).resolve().parents[2]


def _clean_env(**extra: str) -> dict[str, str]:
    return {config.CONFIG_ENV: str(REPO / "configs" / "default.yaml"), **extra}


# obcache_vllm/default.yaml (configs/default.yaml links to it): the built-in (paper) defaults,
# with the selection the rule of configs/choose_defaults.yaml chose for the default model
# (results/choose-defaults/DECISION.md; tests/unit/test_choose_defaults.py checks the file).
SHIPPED = {**config.BUILTIN_DEFAULTS, "kv_pipeline": "snapkv", "kv_window": 32, "kv_per_head": True,
           "kv_scorer": "dropkv"}


def test_shipped_config_file_is_the_builtin_defaults_tuned_for_the_default_model() -> None:
    assert config.load_defaults(_clean_env()) == SHIPPED
    assert config.load_defaults({}) == SHIPPED  # no variable: the packaged file
    assert (REPO / "configs" / "default.yaml").resolve() == config.PACKAGED_CONFIG
    assert set(config.BUILTIN_DEFAULTS) == set(options.FIELDS)
    assert (options.default("kv_pipeline"), options.default("kv_window")) == ("snapkv", 64)  # paper


def test_an_installed_wheel_serves_the_checkouts_defaults(tmp_path: Path) -> None:
    """The wheel built from this tree, unpacked alone (no checkout on the path, another working
    directory): the same defaults, policy and pipelines as the checkout, from its own file."""
    import json
    import os
    import subprocess
    import sys
    import zipfile

    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path / "dist"), str(REPO)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("obcache_vllm-*.whl")
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    script = (
        "import json, obcache_vllm\n"
        "from obcache_vllm import config\n"
        "from obcache_vllm.scoring import pipeline_names\n"
        "p = config.load_policy({})\n"
        "print(json.dumps({'file': obcache_vllm.__file__, 'config': str(config.config_path({})),"
        " 'defaults': p.defaults, 'min_prompt_tokens': p.min_prompt_tokens,"
        " 'pipelines': list(pipeline_names())}))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OBCACHE_")}
    env["PYTHONPATH"] = str(site)
    run = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["file"].startswith(str(site)) and got["config"].startswith(str(site))
    policy = config.load_policy({})
    assert got["defaults"] == policy.defaults == {**SHIPPED}
    assert got["min_prompt_tokens"] == policy.min_prompt_tokens
    from obcache_vllm.scoring import pipeline_names

    assert got["pipelines"] == list(pipeline_names())


def test_file_then_environment_override(tmp_path: Path) -> None:
    path = tmp_path / "kv.yaml"
    path.write_text("kv_budget: 256\nkv_scorer: obcache_joint\nkv_window: 32\n")
    env = {
        config.CONFIG_ENV: str(path),
        "OBCACHE_KV_BUDGET": "0.25",
        "OBCACHE_KV_DECODE": "true",
        "OBCACHE_KV_PIPELINE": "h2o",
    }
    got = config.load_defaults(env)
    assert got == {
        **config.BUILTIN_DEFAULTS,
        "kv_budget": 0.25,
        "kv_scorer": "obcache_joint",
        "kv_window": 32,
        "kv_decode": True,
        "kv_pipeline": "h2o",
    }
    assert config.load_defaults({**env, "OBCACHE_KV_BUDGET": "null"})["kv_budget"] is None


@pytest.mark.parametrize(
    "yaml_text, env, needle",
    [
        pytest.param("kv_scorer: magic\n", {}, "kv_scorer", id="file-scorer"),
        pytest.param("kv_bugdet: 64\n", {}, "kv_bugdet", id="file-unknown-key"),
        pytest.param("- 1\n- 2\n", {}, "mapping", id="file-not-mapping"),
        pytest.param("kv_budget: [\n", {}, "YAML", id="file-bad-yaml"),
        pytest.param("", {"OBCACHE_KV_BUDGET": "0"}, "OBCACHE_KV_BUDGET", id="env-budget-zero"),
        pytest.param("", {"OBCACHE_KV_BUDGET": "1.5"}, "kv_budget", id="env-ratio"),
        pytest.param("", {"OBCACHE_KV_WINDOW": "0"}, "OBCACHE_KV_WINDOW", id="env-window"),
        pytest.param("", {"OBCACHE_KV_PIPELINE": "x"}, "kv_pipeline", id="env-pipeline"),
        pytest.param(
            "kv_budget: 16\n", {"OBCACHE_KV_RECENT": "16"}, "kv_budget", id="sinks+recent"
        ),
    ],
)
def test_invalid_defaults_fail_naming_source_and_key(
    tmp_path: Path, yaml_text: str, env: dict, needle: str
) -> None:
    path = tmp_path / "kv.yaml"
    path.write_text(yaml_text)
    with pytest.raises(config.ConfigError, match=needle):
        config.load_defaults({config.CONFIG_ENV: str(path), **env})


def test_missing_config_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(config.ConfigError, match="cannot read"):
        config.load_defaults({config.CONFIG_ENV: str(tmp_path / "absent.yaml")})


@pytest.mark.parametrize(
    ("variable", "value"), [("OBCACHE_KV_SCORER", "magic"), ("OBCACHE_ENTRY_POOL_SHARE", "2")]
)
def test_serve_refuses_to_start_on_invalid_settings(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, variable: str, value: str
) -> None:
    monkeypatch.setenv(variable, value)
    monkeypatch.setattr(cli, "_run_vllm_serve", lambda argv: pytest.fail("must not start"))
    assert cli.main(["serve"]) == 1
    err = capsys.readouterr().err
    assert variable in err and value in err


DEFAULTS = dict(config.BUILTIN_DEFAULTS)
SET_DEFAULTS = {k: v for k, v in DEFAULTS.items() if v is not None}  # what merging copies


@pytest.mark.parametrize(
    "defaults, requested, expected",
    [
        pytest.param(DEFAULTS, {}, {}, id="no-budget-stays-stock"),
        pytest.param(
            DEFAULTS,
            {"kv_budget": 64},
            {**SET_DEFAULTS, "kv_budget": 64},
            id="budget-gets-defaults",
        ),
        pytest.param(
            {**DEFAULTS, "kv_budget": 128, "kv_scorer": "attn"},
            {"kv_pipeline": "tova"},
            {**SET_DEFAULTS, "kv_budget": 128, "kv_scorer": "attn", "kv_pipeline": "tova"},
            id="default-budget",
        ),
        pytest.param(
            {**DEFAULTS, "kv_budget": 128},
            {"kv_budget": None},
            {},
            id="null-budget-opts-out",
        ),
        pytest.param(
            DEFAULTS, {"kv_scorer": "attn"}, {"kv_scorer": "attn"}, id="option-without-budget"
        ),
    ],
)
def test_merge_fields(defaults: dict, requested: dict, expected: dict) -> None:
    assert admission.merge_fields(defaults, requested) == expected


def test_compress_at_has_no_server_default() -> None:
    with pytest.raises(config.ConfigError, match="kv_compress_at"):
        config.validate_defaults({"kv_compress_at": 100}, "test")


def test_requested_fields_top_level_over_vllm_xargs_and_foreign_keys_ignored() -> None:
    got = server.requested_kv_fields(
        {"kv_budget": 32, "kv_scorer": "random", "kv_transfer_params": {"x": 1}, "other": 1},
        {"kv_scorer": "attn", "kv_foo": 2, "top_p": 0.5},
    )
    assert got == {"kv_budget": 32, "kv_scorer": "attn", "kv_foo": 2}


@pytest.mark.parametrize(
    "merged, field",
    [
        pytest.param({"kv_budget": [64]}, "kv_budget", id="list"),
        pytest.param({"kv_budget": 64, "kv_sinks": {"a": 1}}, "kv_sinks", id="object"),
        pytest.param({"kv_budget": 64, "kv_window": 2**70}, "kv_window", id="int-range"),
        pytest.param({"kv_budget": math.inf}, "kv_budget", id="inf"),
        pytest.param({"kv_budget": math.nan}, "kv_budget", id="nan"),
        pytest.param({"kv_budget": 64, "kv_foo": 1}, "kv_foo", id="unknown"),
        pytest.param({"kv_budget": 20, "kv_sinks": 4, "kv_recent": 16}, "kv_budget", id="sinks"),
    ],
)
def test_parsing_names_the_field(merged: dict, field: str) -> None:
    with pytest.raises(options.KvOptionsError) as info:
        admission.parse_request(merged)
    assert info.value.field == field


def test_parsing_leaves_prompt_dependent_checks_to_admission() -> None:
    # 0.01 of a short prompt is below kv_sinks + kv_recent; only the real prompt can tell.
    admission.parse_request({"kv_budget": 0.01})
    with pytest.raises(options.KvOptionsError):
        admission.parse_kv_options({"kv_budget": 0.01}, num_prompt_tokens=100)


def test_kv_transfer_params_is_not_an_unknown_kv_option() -> None:
    assert admission.parse_kv_options({"kv_transfer_params": {"a": 1}}, 10) is None


class _Res:
    def __init__(self, params):
        self.kv_transfer_params = params


def test_outcome_is_taken_off_kv_transfer_params() -> None:
    res = _Res({"obcache": {"resident_tokens": 3}, "remote": 1})
    assert server.take_outcome(res) == {"resident_tokens": 3}
    assert res.kv_transfer_params == {"remote": 1}
    only = _Res({"obcache": {"resident_tokens": 3}})
    server.take_outcome(only)
    assert only.kv_transfer_params is None
    assert server.take_outcome(_Res(None)) is None


def test_outcomes_of_several_prompts_are_summed() -> None:
    one = {
        "resident_tokens": 70,
        "evicted_tokens": 64,
        "freed_blocks": 2,
        "evictions": 1,
        "prompt_tokens_kept": 66,
        "budget": 64,
        "scorer": "attn",
        "pipeline": "snapkv",
    }
    two = {**one, "resident_tokens": 80, "evicted_tokens": 32, "freed_blocks": 1}
    assert server.combine({0: one}) == one
    total = server.combine({1: two, 0: one})
    assert total["resident_tokens"] == 150 and total["evicted_tokens"] == 96
    assert total["freed_blocks"] == 3 and total["evictions"] == 2 and total["requests"] == 2
    assert total["scorer"] == "attn"
    assert server.combine({}) is None


def test_usage_chunk_injection_touches_only_the_final_usage_chunk() -> None:
    outcome = {0: {"resident_tokens": 5}}
    final = 'data: {"id":"x","choices":[],"usage":{"prompt_tokens":3}}\n\n'
    got = server._inject_into_usage_chunk(final, outcome)
    assert got == (
        'data: {"id":"x","choices":[],"usage":{"prompt_tokens":3,'
        '"obcache":{"resident_tokens":5}}}\n\n'
    )
    content = 'data: {"id":"x","choices":[{"delta":{}}],"usage":{"prompt_tokens":3}}\n\n'
    assert server._inject_into_usage_chunk(content, outcome) == content
    assert server._inject_into_usage_chunk("data: [DONE]\n\n", outcome) == "data: [DONE]\n\n"


def test_a_policy_budget_below_its_threshold_leaves_the_request_stock() -> None:
    server.reset_defaults({**config.BUILTIN_DEFAULTS, "kv_budget": 0.25, "kv_when": "pressure"},
                          min_prompt_tokens=1000)  # fmt: skip
    try:
        policy_request = server.parse_fields(None, {})
        assert policy_request.waived_below == 1000  # beside the client's options, not on them
        assert policy_request.request.budget == 0.25
        assert policy_request.request.when == "pressure"
        gate = admission.Admission(None, admission.CAPABILITIES["cpu"])
        assert gate.admit(policy_request, admission.Prompt(999)) is None  # stock: below it
        own = server.parse_fields(None, {"kv_budget": 64})
        assert own.waived_below is None  # the request's own budget is never waived
        assert server.parse_fields(None, {"kv_budget": None}) is None  # the opt-out
    finally:
        server.reset_defaults()


def test_a_policy_can_default_to_an_error_target(tmp_path: Path) -> None:
    """``kv_budget: {max_error: e}`` in the YAML file, or its scalar form in
    ``OBCACHE_KV_BUDGET``: requests without a budget get the target, compressed whole (the
    policy's compress point does not apply to a target), and a bad target fails at start."""
    path = tmp_path / "kv.yaml"
    path.write_text("kv_budget: {max_error: 0.01}\nkv_pipeline: tova\n")
    assert config.load_defaults({config.CONFIG_ENV: str(path)})["kv_budget"] == {
        "max_error": 0.01}  # fmt: skip
    env = {config.CONFIG_ENV: str(path), "OBCACHE_KV_BUDGET": "max_error:0.02"}
    defaults = config.load_defaults(env)
    assert defaults["kv_budget"] == "max_error:0.02"
    with pytest.raises(config.ConfigError, match="OBCACHE_KV_BUDGET"):
        config.load_defaults({**env, "OBCACHE_KV_BUDGET": "max_error:-1"})
    server.reset_defaults(defaults)
    try:
        requested = server.parse_fields(None, {})
        assert requested.request.budget.max_error == 0.02
        assert requested.request.compress_at is None  # not "auto": a target compresses whole
        assert server.parse_fields(None, {"kv_budget": 64}).request.budget == 64
    finally:
        server.reset_defaults()
