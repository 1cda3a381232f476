"""An 8K-token prompt in a KV pool of 4K tokens: stock vLLM refuses to start; obcache serves it.

Two fresh engines in subprocesses (pool_runner.py), the plugin's on the first of this
process's cores and stock vLLM's on the last (one core each on two; both on a lane's one core
when the suite runs in lanes, tests/support/lanes.py), same settings: 128 blocks of 32
tokens, max_model_len 8192, 512 tokens per prefill chunk. The plugin engine starts (the
start-up check is relaxed to one chunk + two blocks), serves the 8,000-token prompt with
``kv_prefill_evict`` holding at most ceil((budget + chunk) / bs) + 1 blocks, serves a short
stock request, and refuses with a 400-class error naming the field every request that could
never fit: a stock 8K prompt (``max_tokens``), a budgeted one without ``kv_prefill_evict``
(``kv_prefill_evict``).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest
from support.engine import run_pool
from support.texts import haystack

BS, CHUNK, POOL, BUDGET = 32, 512, 128, 512
ENGINE = dict(
    dtype="float32", enforce_eager=True, max_model_len=8192, block_size=BS, seed=0,
    num_gpu_blocks_override=POOL, max_num_batched_tokens=CHUNK, max_num_seqs=8,
)  # fmt: skip


def _run(spec: dict, stock: bool, core: str) -> dict:
    return run_pool(spec, stock, core)


@pytest.fixture(scope="module")
def runs(tokenizer, model_path):
    ids = tokenizer(haystack(300, seed=21)).input_ids
    long_ids, short_ids = ids[:8000], ids[:1500]
    assert len(long_ids) == 8000
    requests = [
        {"id": "bounded", "prompt_token_ids": long_ids, "max_tokens": 16,
         "extra_args": {"kv_budget": BUDGET, "kv_prefill_evict": True, "kv_pipeline": "snapkv",
                        "kv_window": 32}},
        {"id": "stock-long", "prompt_token_ids": long_ids, "max_tokens": 16},
        {"id": "whole-prompt", "prompt_token_ids": long_ids, "max_tokens": 16,
         "extra_args": {"kv_budget": BUDGET}},
        {"id": "stock-short", "prompt_token_ids": short_ids, "max_tokens": 16},
    ]  # fmt: skip
    spec = {"engine": {"model": str(model_path), **ENGINE}, "requests": requests}
    cores = sorted(os.sched_getaffinity(0))
    with ThreadPoolExecutor(2) as pool:
        plugin = pool.submit(_run, spec, False, str(cores[0]))
        stock = pool.submit(_run, spec, True, str(cores[-1]))
        return plugin.result(), stock.result()


@pytest.mark.slow
def test_stock_vllm_refuses_a_pool_smaller_than_the_context(runs):
    _, stock = runs
    assert "start_error" in stock
    assert "max seq len (8192)" in stock["start_error"], stock["start_error"]


@pytest.mark.slow
def test_prompt_twice_the_pool_is_served_with_a_bounded_peak(runs):
    plugin, _ = runs
    assert "start_error" not in plugin, plugin
    assert plugin["pool_blocks"] == POOL - 1
    bounded = plugin["results"]["bounded"]
    assert len(bounded["token_ids"]) == 16
    bound = -(-(BUDGET + CHUNK) // BS) + 1
    assert 0 < bounded["peak_blocks"] <= bound, bounded["peak_blocks"]
    evictions = {r[0].rsplit("-", 1)[0]: r[1:] for r in plugin["finished"]}
    count, kept = evictions["bounded"]
    assert count >= (8000 - BUDGET) // CHUNK
    assert BUDGET <= kept < BUDGET + BS
    short = plugin["results"]["stock-short"]
    assert len(short["token_ids"]) == 16 and short["peak_blocks"] == -(-(1500 + 15) // BS)
    assert plugin["free_at_end"] == POOL - 1


@pytest.mark.slow
@pytest.mark.parametrize(
    ("rid", "param"), [("stock-long", "max_tokens"), ("whole-prompt", "kv_prefill_evict")]
)
def test_a_request_that_can_never_fit_is_refused_naming_the_field(runs, rid, param):
    plugin, _ = runs
    refused = plugin["results"][rid]
    assert refused.get("param") == param, refused
    assert f"the pool holds {POOL - 1}" in refused["error"]
