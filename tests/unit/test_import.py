"""`import obcache_vllm` has no side effects; the plugin entry point is declared and idempotent."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _run(code: str, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, **(env or {})},
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.parametrize(
    "modules",
    [
        pytest.param("obcache_vllm", id="package"),
        pytest.param(
            "obcache_vllm, obcache_vllm.cli, obcache_vllm.model, obcache_vllm.plugin",
            id="package-cli-model-plugin",
        ),
    ],
)
def test_import_has_no_side_effects(modules: str) -> None:
    code = f"""
import json, logging, sys, warnings
before_modules = set(sys.modules)
before_filters = list(warnings.filters)
import {modules}
new = sorted(set(sys.modules) - before_modules)
heavy = [m for m in new if m.split('.')[0] in ('vllm', 'torch', 'transformers', 'numpy')]
loggers = [n for n, lg in logging.Logger.manager.loggerDict.items()
           if isinstance(lg, logging.Logger) and lg.handlers]
print(json.dumps({{
    "heavy": heavy,
    "root_handlers": len(logging.getLogger().handlers),
    "root_level": logging.getLogger().level,
    "loggers_with_handlers": loggers,
    "warnings_changed": warnings.filters != before_filters,
}}))
"""
    report = json.loads(_run(code))
    assert report == {
        "heavy": [],
        "root_handlers": 0,
        "root_level": 30,  # logging.WARNING, untouched
        "loggers_with_handlers": [],
        "warnings_changed": False,
    }


def test_entry_points_are_declared() -> None:
    plugins = {
        e.name: e.value for e in importlib.metadata.entry_points(group="vllm.general_plugins")
    }
    assert plugins.get("obcache") == "obcache_vllm.plugin:register"
    scripts = {e.name: e.value for e in importlib.metadata.entry_points(group="console_scripts")}
    assert scripts.get("obcache-vllm") == "obcache_vllm.cli:main"


@pytest.fixture
def fresh_plugin(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """plugin.register() as in a new process, with vLLM's side (``vllm_ext.install``) stubbed.

    Returns the list that records each call of the stubbed ``install()``.
    """
    import types

    from obcache_vllm import plugin

    calls: list[int] = []
    stub = types.ModuleType("obcache_vllm.vllm_ext.install")
    stub.install = lambda: calls.append(os.getpid())
    monkeypatch.setitem(sys.modules, "obcache_vllm.vllm_ext", types.ModuleType("stub"))
    monkeypatch.setitem(sys.modules, "obcache_vllm.vllm_ext.install", stub)
    monkeypatch.setattr(plugin, "_registered_pid", None)
    return calls


def test_register_is_idempotent_per_process(
    fresh_plugin: list[int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from obcache_vllm.plugin import TRACE_ENV, register

    trace = tmp_path / "trace.txt"
    monkeypatch.setenv(TRACE_ENV, str(trace))
    assert register() is None
    register()
    register()
    pid = os.getpid()
    assert fresh_plugin == [pid]  # vLLM side installed once
    assert trace.read_text().splitlines() == [
        f"{pid} MainProcess registered",
        f"{pid} duplicate",
        f"{pid} duplicate",
    ]


def test_register_after_fork_registers_again(
    fresh_plugin: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A forked child inherits the module state but is a new process: it must install again."""
    from obcache_vllm import plugin

    monkeypatch.setenv(plugin.TRACE_ENV, "")
    plugin.register()
    monkeypatch.setattr(plugin.os, "getpid", lambda: -1)  # as seen from a forked child
    plugin.register()
    assert len(fresh_plugin) == 2


def test_register_without_trace_writes_nothing(
    fresh_plugin: list[int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from obcache_vllm.plugin import TRACE_ENV, register

    monkeypatch.delenv(TRACE_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    register()
    register()
    assert fresh_plugin == [os.getpid()]
    assert list(tmp_path.iterdir()) == []
