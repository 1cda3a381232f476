"""``kv_when: pressure`` on the real engine: stock while the pool has room, compression instead
of preemption when it does not, admission of a prompt that fits only compressed."""

from __future__ import annotations

import pytest
import torch
from support.engine import POOL_BLOCKS, generate, record_preemptions, run_stock
from support.texts import haystack

BS = 32
PRESSURE = {"kv_budget": 128, "kv_when": "pressure", "kv_pipeline": "tova"}


@pytest.fixture
def preemptions(engine, monkeypatch):
    """Every preemption vLLM makes during the test (request id -> output tokens then)."""
    seen = record_preemptions(engine, monkeypatch)
    assert engine.llm.reset_prefix_cache()
    yield seen
    assert engine.free_blocks() == POOL_BLOCKS - 1


def test_no_compression_while_the_pool_has_room(engine, tokenizer, preemptions, engine_kwargs):
    prompts = [tokenizer(haystack(10, seed=60 + i)).input_ids for i in range(3)]
    # The oracle: stock vLLM in its own process (plugin disabled), the same batch.
    (stock,) = run_stock(engine_kwargs, [[
        {"prompt_token_ids": p, "max_tokens": 24, "ignore_eos": True} for p in prompts
    ]])  # fmt: skip
    counts = engine.scheduler.obcache_pressure.counts
    before = counts.compressions
    tokens, usages, _ = generate(engine, prompts, PRESSURE, 24)
    assert tokens == stock  # exactly stock vLLM's tokens
    assert all(u["evictions"] == 0 and "pressure" not in u for u in usages)
    assert counts.compressions == before and not preemptions


def test_compression_instead_of_preemption_when_the_pool_is_short(
    engine, tokenizer, preemptions, engine_kwargs, model_path
):
    """Five requests that outgrow the 95-block pool while they decode: stock vLLM preempts,
    the pressure arm compresses instead. Independent oracles for each of its requests: one
    never compressed answers as the same request on a stock vLLM engine; one compressed while
    it ran answers as the HF reference that computes its prompt and the tokens it had
    generated with the full cache, evicts at the reported length and continues."""
    from obcache_vllm.admission import parse_kv_options
    from obcache_vllm.evidence import hf_reference as ref

    prompts = [tokenizer(haystack(16, seed=70 + i)).input_ids for i in range(5)]
    assert sum(-(-(len(p) + 200) // BS) for p in prompts) > POOL_BLOCKS
    generate(engine, prompts, {}, 200)
    assert preemptions, "the stock run must be pool-limited for this test to mean anything"
    preemptions.clear()
    counts = engine.scheduler.obcache_pressure.counts
    before = (counts.compressions, counts.preemptions_avoided)
    tokens, usages, _ = generate(engine, prompts, PRESSURE, 200)
    assert not preemptions  # avoided: compressed instead
    assert counts.compressions > before[0] and counts.preemptions_avoided > before[1]
    compressed = [u for u in usages if "pressure" in u]
    reasons = {u["pressure"]["reason"] for u in compressed}
    assert "running" in reasons and reasons <= {"running", "admission"}
    assert all(len(t) == 200 for t in tokens)

    (stock,) = run_stock(engine_kwargs, [[
        {"prompt_token_ids": p, "max_tokens": 200, "ignore_eos": True} for p in prompts
    ]])  # fmt: skip
    untouched = [i for i, u in enumerate(usages) if "pressure" not in u]
    assert untouched, "some request must have run uncompressed for this oracle to mean anything"
    for i in untouched:
        assert tokens[i] == stock[i], f"request {i} was never compressed: stock vLLM's tokens"
    model, _ = ref.load_model(model_path)
    for i, usage in enumerate(usages):
        if usage.get("pressure", {}).get("reason") != "running":
            continue
        at = usage["pressure"]["at_tokens"]
        done = at - len(prompts[i])  # tokens generated before the compression
        assert done >= 0
        ids = torch.tensor(prompts[i] + tokens[i][:done])
        options = parse_kv_options({"kv_budget": 128, "kv_pipeline": "tova"}, len(ids))
        result = ref.compress_and_generate(model, ids, options, BS, 200 - done)
        assert result.token_ids == tokens[i][done:], f"request {i}, compressed at {at}"


def test_a_prompt_that_fits_only_compressed_is_admitted_and_evicted_while_prefilled(
    driver, tokenizer
):
    engine = driver.engine
    holders = [driver.add(f"hold{i}", tokenizer(haystack(25, seed=80 + i)).input_ids, 64,
                          ignore_eos=True) for i in range(3)]  # fmt: skip
    for _ in range(12):  # their prompts are in (256 tokens a step), they decode
        driver.step()
    long_prompt = tokenizer(haystack(40, seed=90)).input_ids
    assert -(-len(long_prompt) // BS) > engine.free_blocks()  # whole, it would have to wait
    rid = driver.add("long", long_prompt, 4, **PRESSURE)
    driver.step()
    assert rid in engine.scheduler.obcache_ledger.requests
    assert engine.scheduler.obcache_ledger.requests[rid].pressure == "admission"
    driver.run()
    record = engine.scheduler.obcache_finished[-1]
    assert record.req_id == rid and record.evictions >= 1
    assert all(h in driver.outputs for h in holders)


def test_an_admission_under_pressure_never_copies_kv_the_same_step_writes(driver, tokenizer):
    """The scheduler harness's finding on the real engine: ``r1`` registers a shared
    prefix's blocks in a step (their KV is written by that step's forward pass); ``r2``
    (``kv_when: pressure``) hits them in the same ``schedule()``, does not fit as stock and
    is admitted compressed while prefilled, which copies every hit block it will rewrite.
    Before the fix those copies ran before the forward pass and read blocks not written yet
    (the KV oracle: ``copy_in_flight``; the autouse fixture fails the test on any mismatch).
    Now that admission waits a step, and the copies read written KV."""
    engine = driver.engine
    shared = tokenizer(haystack(4, seed=95)).input_ids[:96]
    holder = tokenizer(haystack(56, seed=96)).input_ids[:1500]
    driver.add("holder", holder, 80, ignore_eos=True)
    for _ in range(7):  # its prompt is in (256 tokens a step); it decodes from here on
        driver.step()
    own = tokenizer(haystack(64, seed=97)).input_ids[:1700]
    long_prompt = shared + own
    assert -(-len(long_prompt) // BS) > engine.free_blocks() - 4  # whole, it cannot fit
    driver.add("r1", shared + [13, 13], 1)
    r2 = driver.add("r2", long_prompt, 2, **PRESSURE)
    driver.step()  # r1 registers the shared blocks; r2 hits them in the same schedule
    record = engine.scheduler.obcache_ledger.get(r2)
    running = [r.request_id for r in engine.scheduler.running]
    # Not admitted in that step (before the fix: admitted under pressure, copying unwritten KV)
    assert record.pressure is None and r2 not in running, (record.pressure, running)
    driver.step()  # the shared blocks hold their KV now: admitted under pressure
    assert record.pressure == "admission"
    driver.run()
    usage = engine.scheduler.obcache_finished[-1]
    assert usage.req_id == r2 and usage.evictions >= 1
    assert engine.free_blocks() == POOL_BLOCKS - 1
