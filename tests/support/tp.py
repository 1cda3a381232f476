"""The tensor-parallel comparison's requests and its probe runner, shared by
tests/engine/test_tensor_parallel_engine.py and benchmarks/tp_compare.py.

``COMPARED``: budgeted requests covering every path that differs under TP (each pipeline,
per-head and per-layer ranking, decode eviction, ``kv_compress_at``, ``kv_prefill_evict``);
one ~380-token prompt each (:func:`prompts`), greedy, :data:`MAX_TOKENS` new tokens.
:func:`run_probe` runs probes/tp_probe.py (one engine at the given TP size) on them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from support.texts import haystack

PROBE = Path(__file__).resolve().parent / "probes" / "tp_probe.py"
KV = {"kv_budget": 128, "kv_pipeline": "snapkv", "kv_scorer": "obcache_key", "kv_window": 16}
COMPARED = {
    "per_head": {**KV, "kv_per_head": True},
    "per_layer": {**KV, "kv_per_head": False},
    "decode": {"kv_budget": 128, "kv_pipeline": "tova", "kv_scorer": "obcache_value",
               "kv_decode": True},
    "h2o": {"kv_budget": 128, "kv_pipeline": "h2o", "kv_scorer": "attn"},
    "streaming": {"kv_budget": 128, "kv_pipeline": "streaming"},
    "compress_at": {**KV, "kv_scorer": "obcache_joint", "kv_compress_at": 200},
    "prefill_evict": {"kv_budget": 96, "kv_pipeline": "tova", "kv_prefill_evict": True},
}  # fmt: skip
OUTCOME_KEYS = ("evictions", "freed_blocks", "prompt_tokens_kept", "resident_tokens")
MAX_TOKENS = 40  # the decode request evicts again after 32 tokens


def prompts(tokenizer, names) -> dict[str, list[int]]:
    """A different text per request (no shared prefix: the prefix cache plays no part)."""
    return {name: tokenizer(haystack(14, seed=21 + i)).input_ids for i, name in enumerate(names)}


def run_probe(tp: int, engine_kwargs: dict, prompt_ids: dict, requests: dict) -> dict:
    """The probe's JSON result for one engine of TP size ``tp``."""
    spec = {"tp": tp, "engine": engine_kwargs, "prompts": prompt_ids, "requests": requests,
            "max_tokens": MAX_TOKENS}  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    proc = subprocess.run([sys.executable, str(PROBE), json.dumps(spec)], env=env,
                          capture_output=True, text=True, timeout=1200)  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("TP_PROBE ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"TP={tp} probe failed:\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len("TP_PROBE "):])
