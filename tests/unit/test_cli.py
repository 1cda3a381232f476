"""The `obcache-vllm` command: model subcommands and the `serve` argument plumbing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from obcache_vllm import cli, model

DEFAULTS = list(cli.SERVE_DEFAULT_ARGS)
NAME = ["--served-model-name", model.MODEL_NAME]


@pytest.mark.parametrize(
    "user, expected, uses_default",
    [
        pytest.param([], ["/m", *DEFAULTS, *NAME], True, id="defaults"),
        pytest.param(
            ["--port", "8001", "--max-model-len", "2048"],
            ["/m", *DEFAULTS, *NAME, "--port", "8001", "--max-model-len", "2048"],
            True,
            id="user-args-last-so-they-win",
        ),
        pytest.param(
            ["--served-model-name", "x"],
            ["/m", *DEFAULTS, "--served-model-name", "x"],
            True,
            id="user-served-name",
        ),
        pytest.param(
            ["/other", "--port", "1"],
            ["/other", *DEFAULTS, "--port", "1"],
            False,
            id="user-model-positional",
        ),
        pytest.param(
            ["--model=/other"], [*DEFAULTS, "--model=/other"], False, id="user-model-option"
        ),
    ],
)
def test_build_serve_argv(user: list[str], expected: list[str], uses_default: bool) -> None:
    assert cli.build_serve_argv(user, Path("/m")) == (expected, uses_default)


def test_serve_env_defaults_do_not_override_the_user() -> None:
    env = cli.serve_env({"VLLM_CPU_KVCACHE_SPACE": "8", "PATH": "/bin"})
    assert env == {"VLLM_CPU_KVCACHE_SPACE": "8", "VLLM_USE_V2_MODEL_RUNNER": "0", "PATH": "/bin"}


def test_serve_provisions_then_runs_vllm_serve(
    provisioned: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict = {}

    def fake_run(argv: list[str]) -> int:
        seen["argv"] = argv
        seen["kv"] = os.environ.get("VLLM_CPU_KVCACHE_SPACE")
        return 0

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.setattr(cli, "_run_vllm_serve", fake_run)
    assert cli.main(["serve", "--port", "8123"]) == 0
    assert seen == {"argv": [str(provisioned), *DEFAULTS, *NAME, "--port", "8123"], "kv": "4"}


def test_serve_with_corrupted_cache_fails_with_the_fix(
    provisioned: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    (provisioned / "tokenizer.json").unlink()
    monkeypatch.setattr(cli, "_run_vllm_serve", lambda argv: pytest.fail("must not start"))
    assert cli.main(["serve"]) == 1
    assert "obcache-vllm model pull --force" in capsys.readouterr().err


def test_model_path_prints_without_converting(
    model_home: Path, capsys: pytest.CaptureFixture
) -> None:
    assert cli.main(["model", "path"]) == 0
    out, err = capsys.readouterr()
    assert out == f"{model_home / 'models' / model.MODEL_NAME}\n"
    assert "not provisioned" in err
    assert not model_home.exists()


def test_model_pull_and_verify_on_a_provisioned_cache(
    provisioned: Path, capsys: pytest.CaptureFixture
) -> None:
    assert cli.main(["model", "pull"]) == 0
    assert cli.main(["model", "path"]) == 0
    assert cli.main(["model", "verify"]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines() == [str(provisioned), str(provisioned), f"ok: {provisioned}"]
    assert err == ""


def test_model_verify_reports_corruption(provisioned: Path, capsys: pytest.CaptureFixture) -> None:
    weights = provisioned / "model.safetensors"
    weights.write_bytes(b"\1" + weights.read_bytes()[1:])
    assert cli.main(["model", "verify"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("obcache-vllm: error: the model cache is corrupted")
    assert "obcache-vllm model pull --force" in err


def test_console_script_is_installed(provisioned: Path) -> None:
    script = Path(sys.executable).parent / "obcache-vllm"
    proc = subprocess.run(
        [str(script), "model", "path"],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        timeout=60,
    )
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, f"{provisioned}\n", "")


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["model", "frobnicate"])
    assert info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_policy_flags_become_the_environment_the_server_reads():
    from obcache_vllm import config

    rest, env = cli.split_policy_args(
        ["--port", "8001", "--default-kv-budget", "0.25", "--default-kv-when=pressure",
         "--default-min-prompt-tokens", "2048"]
    )  # fmt: skip
    assert rest == ["--port", "8001"]
    assert env == {"OBCACHE_KV_BUDGET": "0.25", "OBCACHE_KV_WHEN": "pressure",
                   "OBCACHE_MIN_PROMPT_TOKENS": "2048"}  # fmt: skip
    policy = config.load_policy({**env, "OBCACHE_VLLM_CONFIG": ""})
    assert policy.defaults["kv_budget"] == 0.25 and policy.defaults["kv_when"] == "pressure"
    assert policy.min_prompt_tokens == 2048
    for bad in (["--default-kv-magic", "1"], ["--default-kv-budget"]):
        with pytest.raises(config.ConfigError):
            cli.split_policy_args(bad)
    with pytest.raises(config.ConfigError, match="kv_when"):
        config.load_policy({"OBCACHE_KV_WHEN": "sometimes", "OBCACHE_VLLM_CONFIG": ""})


def test_tensor_parallel_serving_unbinds_the_cpu_ranks_unless_the_user_binds_them() -> None:
    assert cli.tensor_parallel_size(["--port", "8000"]) == 1
    assert cli.tensor_parallel_size(["--tensor-parallel-size", "3"]) == 3
    assert cli.tensor_parallel_size(["-tp=2", "--tensor-parallel-size=3"]) == 3
    assert cli.serve_env({}, ["-tp", "3"])["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in cli.serve_env({}, ["--port", "1"])
    mine = cli.serve_env({"VLLM_CPU_OMP_THREADS_BIND": "0|1"}, ["-tp", "2"])
    assert mine["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
