"""Eviction across vLLM's real processes: orders reach the worker, reports reach the scheduler."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ENGINE_KWARGS
from texts import haystack

BS = 32


@pytest.mark.slow
def test_eviction_in_the_three_process_topology(model_path, tokenizer):
    prompt = tokenizer(haystack(24, seed=77)).input_ids
    budget = 128
    spec = {
        "engine": {"model": str(model_path), **ENGINE_KWARGS},
        "kv": {"kv_budget": budget, "kv_scorer": "obcache_key"},
        "prompt": prompt,
    }
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("mp_probe.py")), json.dumps(spec)],
        env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("MP_PROBE "))
    result = json.loads(line.removeprefix("MP_PROBE "))
    kept = list(result["kept"].values())
    n = len(prompt)
    # The worker process compacted every layer to the block rule's kept count...
    assert kept == [[n - ((n - budget) // BS) * BS]]
    # ...and the scheduler process received its report (otherwise it warns and frees nothing).
    assert "was not applied" not in proc.stderr
    assert "EvictionDesyncError" not in proc.stderr
    assert len(result["tokens"]) >= 1
