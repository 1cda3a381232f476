"""Prefill eviction on the real engine and model: exactness for neighbours, freed blocks, isolation.

Oracles: stock vLLM (plugin disabled, same settings, same batches) for every request without a
budget; vLLM's own block pool for memory (free-block counts, blocks held per request).
"""

from __future__ import annotations

import math
import time

import pytest
from support.engine import POOL_BLOCKS, run_stock
from support.texts import haystack, needle_prompt

BS = 32


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text).input_ids


@pytest.fixture(scope="module")
def prompts(tokenizer) -> dict[str, list[int]]:
    shared = haystack(24, seed=42)
    out = {f"needle{i}": _ids(tokenizer, needle_prompt(20 + 3 * i, seed=i)[0]) for i in range(5)}
    for i, tail in enumerate(["Who traded salt?", "Name a town.", "Which year came first?"]):
        out[f"prefix{i}"] = _ids(tokenizer, shared + f"\nQuestion {i}: {tail} Answer:")
    return out


def _batch(prompts, spec):
    return [
        {"prompt_token_ids": prompts[name], "max_tokens": max_tokens, "extra_args": kv or None}
        for name, max_tokens, kv in spec
    ]


MIXED = [
    ("needle0", 24, {"kv_budget": 0.25}),
    ("needle1", 24, {}),
    ("needle2", 24, {"kv_budget": 100, "kv_pipeline": "h2o", "kv_scorer": "attn"}),
    ("needle3", 24, {}),
    ("needle4", 24, {"kv_budget": 0.5, "kv_pipeline": "tova", "kv_scorer": "obcache_joint"}),
]
# A budget at least the prompt: nothing to evict, so the output must be stock's.
NO_OP = [("needle0", 16, {"kv_budget": 2000, "kv_pipeline": "snapkv"})]
# Shared long prefix: U = uncompressed, C = compressed; order and concurrency matter for the
# prefix cache, so each inner list is one generate call, in this order, on both sides.
PREFIX = [
    [("prefix0", 16, {})],  # U1 registers the prefix
    [("prefix1", 16, {"kv_budget": 0.25})],  # C1 could hit it (must not read it)
    [("prefix2", 16, {})],  # U2 reads it: must still be intact
    [("prefix0", 16, {"kv_budget": 0.3, "kv_scorer": "obcache_value"}), ("prefix1", 16, {})],
]


@pytest.fixture(scope="module")
def stock(engine, engine_kwargs, prompts):
    """Stock vLLM outputs of every batch this module runs (one subprocess)."""
    assert engine  # the plugin engine exists first (session order: same model cache)
    batches = [_batch(prompts, MIXED), _batch(prompts, NO_OP)]
    batches += [_batch(prompts, b) for b in PREFIX]
    results = run_stock(engine_kwargs, batches)
    return {"mixed": results[0], "no_op": results[1], "prefix": results[2:]}


def _generate(engine, prompts, spec):
    from vllm import SamplingParams

    batch = _batch(prompts, spec)
    outs = engine.llm.generate(
        [{"prompt_token_ids": r["prompt_token_ids"]} for r in batch],
        [
            SamplingParams(temperature=0, max_tokens=r["max_tokens"], extra_args=r["extra_args"])
            for r in batch
        ],
        use_tqdm=False,
    )
    return [list(o.outputs[0].token_ids) for o in outs]


def test_budget_at_least_prompt_is_stock(engine, prompts, stock):
    before = engine.scheduler.obcache_totals.evictions
    assert _generate(engine, prompts, NO_OP) == stock["no_op"]
    assert engine.scheduler.obcache_totals.evictions == before
    assert engine.free_blocks() == POOL_BLOCKS - 1


def test_mixed_batch_neighbours_are_stock(engine, prompts, stock):
    totals = engine.scheduler.obcache_totals
    before = (totals.evictions, totals.blocks_freed)
    got = _generate(engine, prompts, MIXED)
    for i, (name, _, kv) in enumerate(MIXED):
        if not kv:
            assert got[i] == stock["mixed"][i], f"unbudgeted {name} differs from stock vLLM"
            assert len(got[i]) == 24
        else:  # a compressed request may stop early; it must still generate
            assert len(got[i]) >= 1
    assert totals.evictions - before[0] == 3
    expected_freed = 0
    for name, _, kv in MIXED:
        if kv:
            n = len(prompts[name])
            budget = kv["kv_budget"]
            budget = budget if isinstance(budget, int) else math.ceil(budget * n)
            expected_freed += (n - budget) // BS
    assert totals.blocks_freed - before[1] == expected_freed
    assert engine.free_blocks() == POOL_BLOCKS - 1


def test_prefix_cache_isolation(engine, prompts, stock):
    for spec, expected in zip(PREFIX, stock["prefix"], strict=True):
        got = _generate(engine, prompts, spec)
        for (name, _, kv), g, e in zip(spec, got, expected, strict=True):
            if not kv:
                assert g == e, f"uncompressed {name} differs from stock after a compressed one"
    # No block of a compressed request was ever registered in the prefix cache.
    cached = engine.pool.cached_block_hash_to_block
    assert engine.free_blocks() == POOL_BLOCKS - 1
    assert len(cached) > 0  # the uncompressed requests did use the prefix cache


def test_eviction_frees_blocks_in_the_same_step(driver, prompts):
    engine = driver.engine
    prompt = prompts["needle3"]
    n, budget = len(prompt), 150
    rid = driver.add("free-now", prompt, 8, kv_budget=budget)
    while engine.scheduler.requests[rid].num_computed_tokens < n:
        driver.step()
    live, resident, _ = driver.trace[-1][rid]
    dead = (n - budget) // BS
    assert resident == n - dead * BS
    assert budget <= resident < budget + BS
    # Blocks for the resident tokens only; the freed ones are back in the pool right now.
    assert live == -(-n // BS) - dead
    assert engine.free_blocks() == POOL_BLOCKS - 1 - live
    driver.run()
    assert engine.free_blocks() == POOL_BLOCKS - 1
    record = engine.scheduler.obcache_finished[-1]
    assert record.req_id == rid and record.evictions == 1
    assert record.resident_tokens == resident + 8 - 1  # decode KV of all but the last token


def test_chunked_prefill_evicts_once_with_the_last_window(driver, prompts):
    engine = driver.engine
    prompt = prompts["needle4"]
    n = len(prompt)
    chunk = 256  # max_num_batched_tokens
    assert n > 2 * chunk, "the prompt must span several prefill chunks"
    window = n % chunk + 40  # longer than the last chunk
    rid = driver.add("chunked", prompt, 4, kv_budget=128, kv_pipeline="snapkv", kv_window=window)
    driver.run()
    record = engine.scheduler.obcache_finished[-1]
    assert record.req_id == rid and record.evictions == 1
    kept = engine.runner.obcache.records[rid]
    q_count, first, last = kept["model.layers.0.self_attn.attn:window"]
    assert (q_count, first, last) == (window, n - window, n - 1)
    k = kept["model.layers.0.self_attn.attn"]
    assert k.shape == (3, n - ((n - 128) // BS) * BS)
    # Sinks (4) and the recent window (16) are kept by every head.
    assert (k[:, :4] == torch_arange(4)).all()
    assert (k[:, -16:] == torch_arange(16) + n - 16).all()


def test_compress_at_evicts_before_the_question(driver, tokenizer):
    """``kv_compress_at``: the chunk is cut at the point, the window ends there, the question is
    prefilled on the compressed cache, and the kept set does not depend on the question."""
    engine = driver.engine
    context = _ids(tokenizer, haystack(26, seed=77))[:700]
    point = len(context)
    assert point > 256 and point % 256 > 40  # the cut falls inside the second chunk
    questions = ["\nQuestion: Which town traded salt? Answer:", "\nQ: Name a year. A:"]
    question_ids = [tokenizer(q, add_special_tokens=False).input_ids for q in questions]
    rids = []
    for i, q in enumerate(question_ids):
        ids = context + q
        rids.append(
            driver.add(
                f"agnostic{i}", ids, 3, ignore_eos=True,
                kv_budget=128, kv_window=32, kv_compress_at=point,
            )
        )
    driver.run()
    layer = "model.layers.0.self_attn.attn"
    for i, rid in enumerate(rids):
        record = engine.runner.obcache.records[rid]
        assert record[layer + ":window"] == (32, point - 32, point - 1)
        kept = record[layer]
        assert kept.shape == (3, point - ((point - 128) // BS) * BS)
        # Some step ended exactly at the compress point, and only then were blocks dropped.
        computed = [step[rid].computed for step in driver.trace if rid in step]
        assert point in computed
        resident = [step[rid].resident for step in driver.trace if rid in step]
        evicted_at = computed.index(point)
        assert resident[evicted_at] == kept.shape[1]
        assert resident[:evicted_at] == computed[:evicted_at]
        # The question was then prefilled in one step on top of the compressed cache; the
        # last step seen here is the first decode step.
        assert computed[evicted_at + 1] == len(context) + len(question_ids[i])
        assert computed[-1] == computed[evicted_at + 1] + 1
        assert resident[-1] == kept.shape[1] + computed[-1] - point
    # Scored with context queries only: both requests kept the same tokens in every layer.
    a, b = (engine.runner.obcache.records[r] for r in rids)
    assert all((a[n] == b[n]).all() for n in a if ":" not in n)
    assert any((a[n][0] != a[n][1]).any() for n in a if ":" not in n)  # per head
    assert engine.free_blocks() == POOL_BLOCKS - 1


def test_shared_selection_keeps_the_same_tokens_in_every_head(driver, tokenizer):
    ids = _ids(tokenizer, haystack(20, seed=78))
    rid = driver.add("shared", ids, 2, kv_budget=96, kv_pipeline="tova", kv_per_head=False)
    driver.run()
    record = driver.engine.runner.obcache.records[rid]
    layers = [n for n in record if ":" not in n]
    assert len(layers) == 30
    for name in layers:
        kept = record[name]
        assert kept.shape[0] == 3 and (kept == kept[0]).all(), name
    assert driver.engine.free_blocks() == POOL_BLOCKS - 1


def torch_arange(n):
    import torch

    return torch.arange(n)


def test_capacity_more_requests_fit(driver, prompts, tokenizer):
    """Same pool, same long prompts: with a 25 % budget more requests run at once."""
    engine = driver.engine
    long_prompts = [_ids(tokenizer, haystack(25, seed=100 + i))[:680] for i in range(8)]
    blocks_each = -(-len(long_prompts[0]) // BS)
    assert blocks_each * 5 > POOL_BLOCKS  # stock cannot hold 5 of them at once

    def measure(**kv) -> int:
        d = type(driver)(engine)
        for i, p in enumerate(long_prompts):
            d.add(f"cap-{bool(kv)}-{i}", p, 16, **kv)
        d.run()
        assert len(d.outputs) == len(long_prompts)
        assert engine.free_blocks() == POOL_BLOCKS - 1  # every block returned
        return d.max_running

    t0 = time.perf_counter()
    stock_like = measure()
    t1 = time.perf_counter()
    budgeted = measure(kv_budget=0.25)
    t2 = time.perf_counter()
    print(f"max running: no budget {stock_like} ({t1 - t0:.1f}s), 25% {budgeted} ({t2 - t1:.1f}s)")
    assert stock_like <= POOL_BLOCKS // blocks_each
    assert budgeted >= stock_like + 2


def test_abort_after_eviction_returns_every_block(driver, prompts):
    engine = driver.engine
    victim = driver.add("abort-me", prompts["needle0"], 200, kv_budget=128)
    neighbour = driver.add("neighbour", prompts["needle1"], 12)
    while len(engine.scheduler.requests[victim].output_token_ids) < 3:
        driver.step()
    assert engine.scheduler.obcache_resident_tokens(victim) < len(prompts["needle0"])
    engine.llm.llm_engine.abort_request(["abort-me"])  # the client's id, as the server does
    out = driver.run()
    assert len(out.get(victim, [])) < 200 and len(out[neighbour]) == 12  # aborted mid-way
    assert engine.free_blocks() == POOL_BLOCKS - 1
    assert victim not in engine.runner.obcache.states


def test_preemption_after_eviction_recomputes_and_returns_every_block(driver, prompts):
    engine = driver.engine
    sched = engine.scheduler
    rid = driver.add("preempt-me", prompts["needle2"], 12, kv_budget=128)
    while len(sched.requests[rid].output_token_ids) < 4:
        driver.step()
    request = sched.requests[rid]
    assert sched.obcache_states[rid].dead > 0
    sched.running.remove(request)
    before = sched.obcache_totals.compressed_preemptions
    sched._preempt_request(request, time.monotonic())  # what vLLM does under memory pressure
    assert sched.obcache_states[rid].dead == 0
    assert sched.obcache_totals.compressed_preemptions == before + 1
    out = driver.run()
    assert len(out[rid]) == 12
    record = sched.obcache_finished[-1]
    assert record.req_id == rid and record.evictions == 2  # evicted again after recompute
    assert engine.free_blocks() == POOL_BLOCKS - 1
