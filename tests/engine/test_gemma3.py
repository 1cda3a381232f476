"""Gemma 3 270M with its real weights (``obcache-vllm model pull --model gemma-3-270m``): a
hybrid sliding-window model (every sixth layer global, the others a 512-token window) starts
with the plugin installed, serves requests without a budget as stock vLLM does, and refuses a
budget naming the reason (vLLM gives it several KV-cache groups; budgets in its global layers
are not built yet). Two fresh engines in subprocesses (``pool_runner.py``), one after the
other.
"""

from __future__ import annotations

import os

import pytest
from support.engine import run_pool

from obcache_vllm import extra_models
from obcache_vllm.textgen import haystack

pytestmark = [pytest.mark.engine, pytest.mark.timeout(1200)]

# Memory: an engine of this model takes about 3.7 GB (fp32 weights, a 262K-token vocabulary);
# the two engines of a test run one after the other, beside the suite's other lane.
ENGINE = dict(dtype="float32", enforce_eager=True, max_model_len=2048, block_size=32, seed=0,
              num_gpu_blocks_override=480, max_num_batched_tokens=256,
              max_num_seqs=4)  # fmt: skip


def _run(spec: dict, stock: bool, core: int) -> dict:
    return run_pool(spec, stock, core, timeout=1100)


@pytest.fixture(scope="module")
def runs():
    from transformers import AutoTokenizer

    model_dir = extra_models.pull(extra_models.GEMMA3_270M)
    tok = AutoTokenizer.from_pretrained(model_dir)
    # Longer than the 512-token window: the sliding layers drop blocks, the global ones not.
    ids = [tok(haystack(60, seed=s)).input_ids[:1500] for s in (1, 2)]
    plain = [{"id": f"plain-{i}", "prompt_token_ids": p, "max_tokens": 24}
             for i, p in enumerate(ids)]  # fmt: skip
    budgeted = [{"id": "budget", "prompt_token_ids": ids[0], "max_tokens": 8,
                 "extra_args": {"kv_budget": 0.25}}]  # fmt: skip
    spec = {"engine": {"model": str(model_dir), **ENGINE}}
    core = sorted(os.sched_getaffinity(0))[0]
    ours = _run({**spec, "requests": plain + budgeted}, False, core)
    stock = _run({**spec, "requests": plain}, True, core)
    return plain, ours, stock


def test_gemma3_serves_stock_requests_as_stock_vllm(runs):
    plain, ours, stock = runs
    for r in plain:
        got = ours["results"][r["id"]]["token_ids"]
        assert len(got) == 24 and got == stock["results"][r["id"]]["token_ids"], r["id"]
    assert ours["free_at_end"] == ours["pool_blocks"]


def test_gemma3_refuses_a_budget_naming_why(runs):
    _, ours, _ = runs
    refused = ours["results"]["budget"]
    assert refused.get("param") == "kv_budget", refused
    assert "sliding-window" in refused["error"] or "hybrid" in refused["error"], refused


def test_a_pool_too_small_for_max_model_len_is_refused_at_start_as_stock_does():
    """The plugin relaxes vLLM's start-up check for single-group models (kv_prefill_evict can
    serve prompts longer than the pool); a hybrid model has no budgets, so its check stays
    stock's. Relaxed, this engine started and a 1,500-token prompt waited forever (an engine
    stall): vLLM's hybrid pool of 160 blocks holds about 800 tokens, max_model_len 2048."""
    model_dir = extra_models.pull(extra_models.GEMMA3_270M)
    spec = {"engine": {"model": str(model_dir), **ENGINE, "num_gpu_blocks_override": 160},
            "requests": []}  # fmt: skip
    core = sorted(os.sched_getaffinity(0))[0]
    ours, stock = _run(spec, False, core), _run(spec, True, core)
    assert "max seq len" in stock.get("start_error", ""), stock
    assert "max seq len" in ours.get("start_error", ""), ours
