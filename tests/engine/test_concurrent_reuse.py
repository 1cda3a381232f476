"""Reuse of KV between requests in flight together, on the real engine: each finding of the
concurrency review, with the workload that showed it.

Every test here also passes the KV oracle (``kv_oracle`` in conftest.py): no entry, adoption or
copy read anything but what its donor left. "Alone" means the same request sent by itself
under a cache salt of its own (so it computes and compresses everything itself).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from support.engine import POOL_BLOCKS, run_stock
from support.texts import haystack

BS = 32


@pytest.fixture
def fresh(engine):
    """An empty prefix cache before; after, the pool whole and no reference left held."""
    assert engine.llm.reset_prefix_cache()
    yield engine
    prefix = engine.scheduler.obcache_prefix
    assert engine.free_blocks() == POOL_BLOCKS - 1
    assert prefix.reclaimable_blocks == prefix.held_blocks  # no request references a held block


def _prompt(tokenizer, seed: int, tokens: int) -> list[int]:
    ids = tokenizer(haystack(80, seed=seed)).input_ids[:tokens]
    assert len(ids) == tokens
    return ids


def _run(driver, arrivals, max_steps=2000):
    """``arrivals``: ``(step, name, prompt, max_tokens, salt, kv)``; returns tokens by name."""
    pending = sorted(arrivals, key=lambda a: a[0])
    ids = {}
    for step in range(max_steps):
        while pending and pending[0][0] <= step:
            _, name, prompt, max_tokens, salt, kv = pending.pop(0)
            ids[name] = driver.add(name, prompt, max_tokens, salt=salt, **kv)
        if not pending and not driver.engine.llm.llm_engine.has_unfinished_requests():
            break
        driver.step()
    return {name: driver.outputs[internal] for name, internal in ids.items()}


def _alone(driver, name, prompt, max_tokens, kv):
    return _run(driver, [(0, name, prompt, max_tokens, f"alone-{name}", kv)])[name]


def test_differently_budgeted_copies_of_a_prompt_in_one_step_keep_stock_tokens(
    fresh, driver, tokenizer, engine_kwargs
):
    """A compresses, B (budget over its whole sequence) does not; both prefill in the same
    step. B's hit is A's blocks, registered as A's chunk is scheduled and written only by the
    step's forward pass: B must not copy them before (it used to, and decoded garbage)."""
    prompts = [_prompt(tokenizer, seed, 120) for seed in (1, 2, 3)]
    (stock,) = run_stock(
        engine_kwargs, [[{"prompt_token_ids": p, "max_tokens": 16} for p in prompts]]
    )
    compress = {"kv_budget": 32, "kv_scorer": "obcache_key"}
    whole = {"kv_budget": 1000, "kv_scorer": "obcache_key"}
    for i, prompt in enumerate(prompts):
        out = _run(driver, [(0, f"a{i}", prompt, 16, None, compress),
                            (0, f"b{i}", prompt, 16, None, whole)])  # fmt: skip
        assert out[f"b{i}"] == stock[i], i
        (a,) = [r for r in fresh.scheduler.obcache_finished if r.req_id.startswith(f"a{i}-")]
        assert a.evictions == 1  # A did compress in that step


@pytest.mark.parametrize(
    "kv",
    [
        pytest.param({"kv_pipeline": "tova"}, id="tova"),
        pytest.param(
            {"kv_pipeline": "snapkv", "kv_window": 8, "kv_decode": True}, id="snapkv-decode"
        ),
    ],
)
def test_questions_over_one_document_in_flight_together_match_each_alone(
    fresh, driver, tokenizer, kv
):
    """The first question compresses the document (its length is not a multiple of the block
    size, so adopters copy a partial last block); the others arrive in the steps before, at
    and after the step that makes the entry, and each gets the tokens it gets alone."""
    engine = fresh
    doc = _prompt(tokenizer, 7, 700)  # three chunks of 256: the entry is made at step 2
    questions = [tokenizer(f" Question {i}: which town traded the most in season {i}? Answer:")
                 .input_ids for i in range(6)]  # fmt: skip
    kv = {"kv_budget": 0.25, "kv_compress_at": len(doc), **kv}
    prefix = engine.scheduler.obcache_prefix
    counts = dict(prefix.counts)
    checks = engine.runner.obcache.oracle.checks
    together = _run(driver, [(i, f"q{i}", doc + q, 12, None, kv) for i, q in enumerate(questions)])
    hits = prefix.counts.get(("compress_at", "hit"), 0) - counts.get(("compress_at", "hit"), 0)
    assert hits >= 3  # followers admitted after the entry was made adopted it
    assert engine.runner.obcache.oracle.checks - checks >= hits + 1  # the entry and each adopter
    donor_kept = _kept(engine, driver.internal["q0"])
    assert engine.llm.reset_prefix_cache()
    for i, q in enumerate(questions):
        assert together[f"q{i}"] == _alone(driver, f"alone{i}", doc + q, 12, kv), i
    # The donor kept, layer by layer, exactly what the same request alone keeps.
    assert _kept(engine, driver.internal["alone0"]) == donor_kept


def _kept(engine, req_id):
    record = engine.runner.obcache.records[req_id]
    return {layer: keep.tolist() for layer, keep in record.items() if ":" not in layer}


def test_reset_prefix_cache_right_after_a_compress_step(fresh, driver, tokenizer):
    """The entry's copies are queued until the next step: a reset that preempts every running
    request must still succeed (it raised), and the requests then finish as alone."""
    engine = fresh
    doc = _prompt(tokenizer, 9, 600)
    q = tokenizer(" Question: which season? Answer:").input_ids
    kv = {"kv_budget": 0.25, "kv_compress_at": len(doc), "kv_pipeline": "tova"}
    prefix = engine.scheduler.obcache_prefix
    created = prefix.counts.get(("compress_at", "created"), 0)
    internal = driver.add("donor", doc + q, 8, **kv)
    while prefix.counts.get(("compress_at", "created"), 0) == created:
        driver.step()
    assert engine.scheduler.reset_prefix_cache(reset_running_requests=True)
    assert len(prefix.entries) == 0
    driver.run()
    assert driver.outputs[internal] == _alone(driver, "again", doc + q, 8, kv)


def test_a_lookup_whose_allocation_failed_leaves_no_adoption_behind(fresh, driver, tokenizer):
    """vLLM looks a waiting request up again when its allocation failed; if the entry it found
    is gone by then, it must start from nothing (not from the first lookup's dead blocks), and
    its lookup is counted once, at admission."""
    engine = fresh
    scheduler = engine.scheduler
    prefix = scheduler.obcache_prefix
    doc = _prompt(tokenizer, 11, 500)
    q1, q2 = (tokenizer(f" Question {i}: which year? Answer:").input_ids for i in (1, 2))
    kv = {"kv_budget": 0.25, "kv_compress_at": len(doc), "kv_pipeline": "tova"}
    _run(driver, [(0, "donor", doc + q1, 4, None, kv)])
    (entry,) = list(prefix.entries)
    counts = dict(prefix.counts)
    internal = driver.add("follower", doc + q2, 8, **kv)
    request = scheduler.requests[internal]
    blocks = scheduler.obcache_ledger.get(internal)
    computed, tokens, _, _ = scheduler._get_local_prefix_cache_hit(request)  # a first lookup
    assert tokens == len(doc) and blocks.start is not None and blocks.dead > 0
    assert prefix.entries.remove(entry)  # ... the allocation failed, and the entry is gone
    prefix._release([entry], evicted=True)
    driver.run()
    (record,) = [r for r in scheduler.obcache_finished if r.req_id == internal]
    assert record.evictions == 1  # computed and compressed the document itself
    assert prefix.counts.get(("compress_at", "hit"), 0) == counts.get(("compress_at", "hit"), 0)
    assert prefix.counts[("compress_at", "miss")] == counts.get(("compress_at", "miss"), 0) + 1
    assert driver.outputs[internal] == _alone(driver, "alone", doc + q2, 8, kv)


def test_entry_keys_tell_multimodal_inputs_in_the_tail_apart(engine):
    """vLLM's block hash covers multimodal inputs in full blocks only: two prompts whose
    partial last block holds the placeholders of different images must not share an entry."""
    prefix = engine.scheduler.obcache_prefix

    def request(image: str):
        feature = SimpleNamespace(identifier=image, mm_position=SimpleNamespace(offset=40))
        return SimpleNamespace(
            block_hashes=[b"h0"], all_token_ids=list(range(50)), lora_request=None,
            cache_salt=None, mm_features=[feature],
        )  # fmt: skip

    blocks = SimpleNamespace(entry_options=lambda kind: ("same",))
    one = prefix.key_at(request("image-1"), blocks, "compress_at", 50)
    other = prefix.key_at(request("image-2"), blocks, "compress_at", 50)
    assert one != other and one.tail == other.tail and one.prefix_hash == other.prefix_hash
    assert prefix.key_at(request("image-1"), blocks, "compress_at", 50) == one
    # An input that starts after the entry's tokens is not part of its key.
    assert prefix.key_at(request("image-1"), blocks, "compress_at", 40).mm == ()


def test_a_turn_takes_over_its_parents_hold_and_outlives_its_release(fresh, tokenizer):
    """A turn's entry holds every block it keeps of the entry it continued, so the parent's
    hold passes to it (the parent no longer competes for the held share), and releasing the
    parent leaves the turn's entry valid (a block both list keeps the parent's tag)."""
    from vllm import SamplingParams

    engine = fresh
    prefix = engine.scheduler.obcache_prefix
    session = {"kv_budget": 160, "kv_session": True, "kv_pipeline": "tova"}
    messages = [{"role": "system", "content": "Records:\n" + haystack(18, seed=3)}]
    params = SamplingParams(temperature=0, max_tokens=12, extra_args=session)
    made = []
    for question in ("Which towns appear?", "What was traded?"):
        messages.append({"role": "user", "content": question})
        before = {e.entry_id for e in prefix.entries}
        out = engine.llm.chat(messages, params, use_tqdm=False)[0]
        messages.append({"role": "assistant", "content": out.outputs[0].text})
        (new,) = [e for e in prefix.entries if e.entry_id not in before]
        made.append(new)
    parent, child = made
    assert parent.entry_id not in prefix.held and child.entry_id in prefix.held  # hold passed
    assert prefix.entries.remove(parent)
    prefix._release([parent], evicted=True)
    assert prefix.valid(child)


def test_held_blocks_an_adopter_runs_on_are_not_counted_reclaimable(fresh, driver, tokenizer):
    """The pressure planner counts held blocks as room for running requests; those a running
    adopter references would not come back, so they are not counted."""
    engine = fresh
    prefix = engine.scheduler.obcache_prefix
    doc = _prompt(tokenizer, 13, 500)
    q1, q2 = (tokenizer(f" Question {i}: which crates? Answer:").input_ids for i in (1, 2))
    kv = {"kv_budget": 0.25, "kv_compress_at": len(doc), "kv_pipeline": "tova"}
    _run(driver, [(0, "donor", doc + q1, 4, None, kv)])
    assert prefix.held_blocks > 0 and prefix.reclaimable_blocks == prefix.held_blocks
    driver.add("adopter", doc + q2, 8, **kv)
    driver.step()
    assert prefix.reclaimable_blocks < prefix.held_blocks
    driver.run()
