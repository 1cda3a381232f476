"""Eviction across vLLM's real processes: orders reach the worker, reports reach the scheduler."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from support.engine import ENGINE_KWARGS, PROBES
from support.texts import haystack

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
        [sys.executable, str(PROBES / "mp_probe.py"), json.dumps(spec)],
        env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("MP_PROBE "))
    result = json.loads(line.removeprefix("MP_PROBE "))
    kept = list(result["kept"].values())
    n = len(prompt)
    # The worker process compacted every layer to the block rule's kept count...
    assert kept == [[n - ((n - budget) // BS) * BS]]
    # ...and the EngineCore process received its report: the scheduler counts the eviction and
    # frees the dead blocks only when it commits the worker's report (BlockLedger.commit), and
    # the outcome it attaches to the request's output says so.
    outcome = result["outcome"]
    assert outcome["evictions"] == 1
    assert outcome["freed_blocks"] == (n - budget) // BS
    assert outcome["prompt_tokens_kept"] == kept[0][0]
    assert len(result["tokens"]) >= 1
