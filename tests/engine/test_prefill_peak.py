"""kv_prefill_evict on the real engine: the prompt's peak is bounded while it is prefilled.

Shared engine: 96 blocks of 32 tokens, 256 batched tokens per step (the prefill chunk). The
bound of a prefill step: ceil((budget + chunk) / bs) + 1 blocks (planning.peak_blocks).
"""

from __future__ import annotations

import pytest
from support.engine import POOL_BLOCKS
from support.texts import haystack

BS, CHUNK = 32, 256


@pytest.fixture(scope="module")
def long_prompt(tokenizer) -> list[int]:
    ids = tokenizer(haystack(70, seed=11)).input_ids[:1900]
    assert len(ids) == 1900
    return ids


@pytest.mark.parametrize(
    "kv",
    [
        pytest.param({"kv_pipeline": "snapkv", "kv_window": 16}, id="snapkv"),
        pytest.param({"kv_pipeline": "h2o", "kv_scorer": "obcache_value"}, id="h2o"),
        pytest.param({"kv_pipeline": "tova", "kv_per_head": False}, id="tova-shared"),
    ],
)
def test_prefill_never_holds_more_than_budget_plus_one_chunk(driver, long_prompt, kv):
    engine, budget = driver.engine, 128
    rid = driver.add("peak", long_prompt, 8, kv_budget=budget, kv_prefill_evict=True, **kv)
    bound = -(-(budget + CHUNK) // BS) + 1
    out = driver.run()
    held = [step[rid] for step in driver.trace if rid in step]
    prefill = [h for h in held if h.computed <= len(long_prompt)]
    assert len(prefill) >= len(long_prompt) // CHUNK  # one entry per chunk at least
    assert max(h.blocks for h in held) <= bound, [h.blocks for h in held]
    # Each chunk ended at most one block over budget once compacted.
    assert all(h.resident < budget + BS for h in prefill if h.computed >= budget + BS)
    record = engine.scheduler.obcache_finished[-1]
    assert record.req_id == rid
    assert record.evictions >= (len(long_prompt) - budget) // CHUNK  # every chunk evicted
    assert budget <= record.kept_prompt < budget + BS
    assert record.tokens_evicted == len(long_prompt) - record.kept_prompt
    assert len(out[rid]) >= 1
    assert engine.free_blocks() == POOL_BLOCKS - 1


def test_admitted_by_its_bounded_peak_when_the_whole_prompt_would_not_fit(driver, long_prompt):
    """With most of the pool taken, a kv_prefill_evict request is admitted and served, while
    the same prompt without it has to wait until the pool drains."""
    engine = driver.engine
    hog = long_prompt[:1500]  # 47 blocks + its output, held while it decodes
    driver.add("hog", hog, 120, ignore_eos=True)
    while engine.scheduler.requests[driver.internal["hog"]].num_computed_tokens < len(hog):
        driver.step()
    free = engine.free_blocks()
    assert free < -(-len(long_prompt) // BS)  # the whole prompt does not fit now
    bounded = driver.add("bounded", long_prompt, 4, kv_budget=96, kv_prefill_evict=True)
    whole = driver.add("whole", long_prompt, 4, kv_budget=96)
    driver.step()
    running = {r.request_id for r in engine.scheduler.running}
    assert bounded in running and whole not in running
    driver.run()
    assert set(driver.outputs) >= {bounded, whole, driver.internal["hog"]}
    assert engine.free_blocks() == POOL_BLOCKS - 1


@pytest.mark.parametrize(
    "kv",
    [
        pytest.param({"kv_prefill_evict": True, "kv_pipeline": "snapkv", "kv_window": 8},
                     id="prefill-evict"),
        pytest.param({"kv_compress_at": 600, "kv_pipeline": "tova"}, id="compress-at"),
    ],
)  # fmt: skip
def test_mid_prompt_evictions_then_decode_eviction(driver, long_prompt, kv):
    """A window pipeline evicts before the prompt's end (no running scores yet), then keeps
    evicting while it generates (the fuzzer's 'cannot keep 24 of 0 resident entries')."""
    engine, budget = driver.engine, 96
    faults_before = sum(engine.scheduler.obcache_totals.failures.values())
    rid = driver.add("mid", long_prompt[:900], 80, ignore_eos=True, kv_budget=budget,
                     kv_decode=True, **kv)  # fmt: skip
    out = driver.run()
    assert len(out[rid]) == 80
    record = engine.scheduler.obcache_finished[-1]
    assert record.req_id == rid and record.evictions >= 3
    assert budget <= record.resident_tokens < budget + BS + 1
    assert sum(engine.scheduler.obcache_totals.failures.values()) == faults_before  # none
    assert engine.free_blocks() == POOL_BLOCKS - 1
