"""``kv_when: pressure`` on the real engine: stock while the pool has room, compression instead
of preemption when it does not, admission of a prompt that fits only compressed."""

from __future__ import annotations

import pytest
import torch
from support.engine import POOL_BLOCKS, run_stock
from support.texts import haystack

BS = 32
PRESSURE = {"kv_budget": 128, "kv_when": "pressure", "kv_pipeline": "tova"}


@pytest.fixture
def preemptions(engine, monkeypatch):
    """Every preemption vLLM makes during the test (request ids)."""
    seen: list[str] = []
    original = engine.scheduler._preempt_request

    def counting(request, *args, **kwargs):
        seen.append(request.request_id)
        return original(request, *args, **kwargs)

    monkeypatch.setattr(engine.scheduler, "_preempt_request", counting)
    assert engine.llm.reset_prefix_cache()
    yield seen
    assert engine.free_blocks() == POOL_BLOCKS - 1


def _generate(engine, prompts, kv, max_tokens):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                            extra_args=dict(kv) or None)  # fmt: skip
    outs = engine.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], [
        (o.kv_transfer_params or {}).get("obcache") for o in outs
    ]


def test_no_compression_while_the_pool_has_room(engine, tokenizer, preemptions, engine_kwargs):
    prompts = [tokenizer(haystack(10, seed=60 + i)).input_ids for i in range(3)]
    # The oracle: stock vLLM in its own process (plugin disabled), the same batch.
    (stock,) = run_stock(engine_kwargs, [[
        {"prompt_token_ids": p, "max_tokens": 24, "ignore_eos": True} for p in prompts
    ]])  # fmt: skip
    counts = engine.scheduler.obcache_pressure.counts
    before = counts.compressions
    tokens, usages = _generate(engine, prompts, PRESSURE, 24)
    assert tokens == stock  # exactly stock vLLM's tokens
    assert all(u["evictions"] == 0 and "pressure" not in u for u in usages)
    assert counts.compressions == before and preemptions == []


def test_compression_instead_of_preemption_when_the_pool_is_short(
    engine, tokenizer, preemptions, engine_kwargs, model_path
):
    """Five requests that outgrow the 95-block pool while they decode: stock vLLM preempts,
    the pressure arm compresses instead. Independent oracles for each of its requests: one
    never compressed answers as the same request on a stock vLLM engine; one compressed while
    it ran answers as the HF reference that computes its prompt and the tokens it had
    generated with the full cache, evicts at the reported length and continues."""
    from obcache_vllm.evidence import hf_reference as ref
    from obcache_vllm.options import parse_kv_options

    prompts = [tokenizer(haystack(16, seed=70 + i)).input_ids for i in range(5)]
    assert sum(-(-(len(p) + 200) // BS) for p in prompts) > POOL_BLOCKS
    _generate(engine, prompts, {}, 200)
    assert preemptions, "the stock run must be pool-limited for this test to mean anything"
    preemptions.clear()
    counts = engine.scheduler.obcache_pressure.counts
    before = (counts.compressions, counts.preemptions_avoided)
    tokens, usages = _generate(engine, prompts, PRESSURE, 200)
    assert preemptions == []  # avoided: compressed instead
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
