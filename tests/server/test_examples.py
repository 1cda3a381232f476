"""The scripts in examples/ run as printed, the way a user runs them (a subprocess, this venv's
python); the quickstart page includes them verbatim. HTTP ones against the session's server;
the offline one starts its own engine, as a user's script does."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _run(name: str, *args: str, timeout: int = 600) -> str:
    env = {k: v for k, v in os.environ.items()
           if k not in ("VLLM_ENABLE_V1_MULTIPROCESSING", "OBCACHE_VLLM_RECORD_KEEP")}  # fmt: skip
    proc = subprocess.run([sys.executable, str(EXAMPLES / name), *args], env=env,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip
    assert proc.returncode == 0, f"{name}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


def _usage(line: str) -> dict:
    return ast.literal_eval(line.split("usage.obcache:", 1)[1].strip())


def test_chat_client(server):
    out = _run("chat_client.py", "--base-url", server.base_url)
    usage = _usage(next(x for x in out.splitlines() if "usage.obcache" in x))
    assert usage["evicted_tokens"] > 0 and 128 <= usage["prompt_tokens_kept"] < 128 + 32


def test_shared_document(server):
    out = _run("shared_document.py", "--base-url", server.base_url).splitlines()
    reused = [int(re.search(r"reused_tokens=(\d+)", x).group(1)) for x in out]
    assert len(reused) == 4 and reused[0] == 0 and all(r > 0 for r in reused[1:]), out


def test_session_chat(server):
    out = _run("session_chat.py", "--base-url", server.base_url).splitlines()
    turns = [re.search(r"session_turn=(\w+)", x).group(1) for x in out]
    assert turns == ["None", "2", "3"], out


def test_metrics(server):
    out = _run("metrics.py", "--url", server.url)
    assert "vllm:obcache_evicted_tokens_total" in out


@pytest.mark.slow
def test_offline():
    out = _run("offline.py", "--max-tokens", "8")
    usage = _usage(next(x for x in out.splitlines() if "usage.obcache" in x))
    assert usage["budget"] == 128 and 128 <= usage["prompt_tokens_kept"] < 128 + 32
