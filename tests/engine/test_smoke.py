"""Smoke tests on the real model: the session engine, and the README's server in its real topology.

The session's `llm` (tests/engine/conftest.py) runs EngineCore and worker inside pytest. The
session's `server` fixture (tests/conftest.py) runs `obcache-vllm serve` as a user does, with
vLLM's normal processes (API server -> EngineCore -> worker), so the plugin is checked in every
one of them.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def _greedy(max_tokens: int):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def _registrations(trace: Path) -> tuple[Counter, set[str], list[str]]:
    """(registrations per pid, process names, lines) from a plugin trace file."""
    lines = trace.read_text(encoding="utf-8").splitlines()
    registered = [line.split() for line in lines if line.endswith(" registered")]
    return Counter(pid for pid, _, _ in registered), {name for _, name, _ in registered}, lines


# --- The session engine -------------------------------------------------------------------------


def test_chat_capital_of_france_is_paris(llm) -> None:
    answer = llm.chat(QUESTION, _greedy(32), use_tqdm=False)[0].outputs[0].text
    assert "Paris" in answer, answer


def test_greedy_generation_is_deterministic(llm) -> None:
    prompt = "The three primary colors are"
    first, second = (
        llm.generate([prompt], _greedy(16), use_tqdm=False)[0].outputs[0] for _ in range(2)
    )
    assert first.token_ids == second.token_ids
    assert len(first.token_ids) == 16 or first.finish_reason == "stop"


def test_plugin_registered_once_in_this_process(llm, plugin_trace_file: Path) -> None:
    llm.generate(["Hello"], _greedy(1), use_tqdm=False)
    per_pid, _, lines = _registrations(plugin_trace_file)
    assert per_pid[str(os.getpid())] == 1, lines


@pytest.mark.parametrize(
    "plugins, loaded",
    [
        pytest.param(None, True, id="unset-loads-all"),
        pytest.param("obcache", True, id="named"),
        pytest.param("", False, id="empty-loads-none"),
    ],
)
def test_vllm_plugins_filter_switches_the_plugin(plugins, loaded, monkeypatch) -> None:
    """VLLM_PLUGINS is the switch between obcache and stock vLLM in the same install."""
    import vllm.envs as envs
    from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_plugins_by_group

    # Read VLLM_PLUGINS afresh even if this process cached vLLM's env (restored after the test).
    monkeypatch.setattr(
        envs, "__getattr__", getattr(envs.__getattr__, "__wrapped__", envs.__getattr__)
    )
    if plugins is None:
        monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    else:
        monkeypatch.setenv("VLLM_PLUGINS", plugins)
    found = load_plugins_by_group(DEFAULT_PLUGINS_GROUP)
    assert ("obcache" in found) is loaded
    if loaded:
        from obcache_vllm.plugin import register

        assert found["obcache"] is register


# --- The README's server: `obcache-vllm serve` on the default model -----------------------------


# The session's `server` fixture (tests/conftest.py, tests/support/server.py) is shared with
# tests/server: one server start per session.


@pytest.mark.server
def test_server_answers_chat_on_the_default_model(server) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=120)
    assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct"]
    reply = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=QUESTION, temperature=0, max_tokens=32
    )
    assert "Paris" in reply.choices[0].message.content


@pytest.mark.server
def test_plugin_registered_once_in_every_server_process(server) -> None:
    """API server, EngineCore and worker each load the plugin exactly once."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=120)
    client.completions.create(model="SmolLM2-135M-Instruct", prompt="Hello", max_tokens=1)
    per_pid, names, lines = _registrations(server.trace)

    assert per_pid[str(server.pid)] == 1, lines  # the API server (front-end)
    assert len(per_pid) >= 3, lines
    assert all(count == 1 for count in per_pid.values()), lines
    assert any(n.startswith("EngineCore") for n in names), names
    assert any(n.startswith("VllmWorker") for n in names), names
    # vLLM guards its own loader: a duplicate line would mean a second load reached us.
    assert not [line for line in lines if line.endswith(" duplicate")], lines
