"""Budgeted requests and vLLM's prefix cache on the real engine: exact reads, compressed reuse,
stock blocks kept for others, KV events that tell the truth, isolation, the pool whole after.

"Exact" is checked against a recompute of the same request after ``reset_prefix_cache`` (same
engine, same chunking): the same kept tokens in every layer and the same output tokens.
"""

from __future__ import annotations

import contextlib

import pytest
from support.engine import POOL_BLOCKS, run_stock
from support.texts import haystack

BS = 32


@pytest.fixture
def fresh(engine):
    """An engine with an empty prefix cache (and no compressed entries)."""
    assert engine.llm.reset_prefix_cache()
    assert len(engine.scheduler.obcache_prefix.entries) == 0
    yield engine
    assert engine.free_blocks() == POOL_BLOCKS - 1


@pytest.fixture(scope="module")
def stock(engine_kwargs, tokenizer):
    """Stock vLLM's tokens for the document's two questions, asked in this order (the second
    reads the first's cached blocks, as here), and for the holder of the isolation test."""
    doc, (q1, q2) = _doc(tokenizer), _questions(tokenizer)
    batches = [
        [{"prompt_token_ids": doc + q1, "max_tokens": 8}],
        [{"prompt_token_ids": doc + q2, "max_tokens": 8}],
        [{"prompt_token_ids": doc + q1, "max_tokens": 24, "ignore_eos": True}],
    ]
    (first,), (second,), (holder,) = run_stock(engine_kwargs, batches)
    return {"q1": first, "q2": second, "holder": holder}


def _doc(tokenizer, sentences=22, seed=41):
    return tokenizer(haystack(sentences, seed=seed)).input_ids


def _questions(tokenizer):
    return [
        tokenizer(" Question: which town traded the most crates? Answer:").input_ids,
        tokenizer(" Question: in which season did it happen? Answer:").input_ids,
    ]


@contextlib.contextmanager
def _counting_preemptions(engine):
    """The ids of the requests the scheduler preempts inside the block."""
    preempted, preempt = [], engine.scheduler._preempt_request

    def counting(request, *args, **kwargs):
        preempted.append(request.request_id)
        return preempt(request, *args, **kwargs)

    engine.scheduler._preempt_request = counting
    try:
        yield preempted
    finally:
        del engine.scheduler._preempt_request


def _generate(engine, prompt, kv=None, max_tokens=8, ignore_eos=False):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos,
                            extra_args=dict(kv or {}) or None)  # fmt: skip
    out = engine.llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    usage = (out.kv_transfer_params or {}).get("obcache")
    return list(out.outputs[0].token_ids), out.num_cached_tokens, usage, out.request_id


def _kept(engine, request_id):
    """Kept indices per layer of the request's last eviction (the worker's records; the
    engine's request ids carry a suffix after the one ``generate`` returns)."""
    records = engine.runner.obcache.records
    (key,) = [k for k in records if k == request_id or k.startswith(f"{request_id}-")]
    record = records[key]
    return {layer: keep.tolist() for layer, keep in record.items() if ":" not in layer}


@pytest.mark.parametrize(
    "kv",
    [
        pytest.param({"kv_pipeline": "tova", "kv_per_head": False}, id="tova"),
        pytest.param({"kv_pipeline": "snapkv", "kv_window": 16}, id="snapkv"),
    ],
)
def test_budgeted_reads_are_exact_and_keep_the_document_cacheable(fresh, tokenizer, stock, kv):
    engine = fresh
    doc, (q1, q2) = _doc(tokenizer), _questions(tokenizer)
    kv = {"kv_budget": 0.25, "kv_scorer": "obcache_key", **kv}
    first, cached, usage, _ = _generate(engine, doc + q1, kv)
    assert cached == 0 and usage["evictions"] == 1
    # The follow-up reads the document: blocks the first registered below its write floor,
    # and the stock blocks its compaction overwrote, copied aside for the cache.
    tokens, cached, usage, rid = _generate(engine, doc + q2, kv)
    window = kv.get("kv_window", 1)
    assert cached == (len(doc + q2) - window) // BS * BS >= len(doc) // BS * BS - BS
    assert usage["cached_tokens"] == cached
    kept = _kept(engine, rid)
    assert engine.llm.reset_prefix_cache()
    again, cached_again, _, rid_again = _generate(engine, doc + q2, kv)
    assert cached_again == 0
    assert tokens == again and kept == _kept(engine, rid_again)  # exact: as recomputed
    # A stock request reads the whole document the budgeted ones left (and keeps stock text).
    engine.llm.reset_prefix_cache()
    _generate(engine, doc + q1, kv)
    stock_tokens, stock_cached, _, _ = _generate(engine, doc + q2)
    assert stock_cached == (len(doc + q2) - 1) // BS * BS
    assert stock_tokens == stock["q2"]


def test_compress_at_entries_are_adopted_exactly(fresh, tokenizer):
    engine = fresh
    doc, (q1, q2) = _doc(tokenizer), _questions(tokenizer)
    kv = {"kv_budget": 0.25, "kv_compress_at": len(doc), "kv_pipeline": "tova"}
    counts = engine.scheduler.obcache_prefix.counts
    before = dict(counts)
    _, _, first, _ = _generate(engine, doc + q1, kv)
    assert first["evictions"] == 1 and "reused_tokens" not in first
    assert counts[("compress_at", "created")] == before.get(("compress_at", "created"), 0) + 1
    tokens, cached, usage, _ = _generate(engine, doc + q2, kv)
    assert cached == len(doc) and usage["reused_tokens"] == len(doc)
    assert usage["reused_from"] == "compress_at" and usage["evictions"] == 0
    assert usage["prompt_tokens_kept"] == first["prompt_tokens_kept"] - len(q1) + len(q2)
    assert counts[("compress_at", "hit")] == before.get(("compress_at", "hit"), 0) + 1
    # Other options or another salt: no adoption.
    other, _, other_usage, _ = _generate(engine, doc + q2, {**kv, "kv_recent": 8})
    assert "reused_tokens" not in other_usage
    assert engine.llm.reset_prefix_cache()
    assert len(engine.scheduler.obcache_prefix.entries) == 0
    again, cached_again, _, _ = _generate(engine, doc + q2, kv)
    assert cached_again == 0 and tokens == again


def test_held_entries_survive_traffic_give_way_to_requests_then_die_cleanly(fresh, tokenizer):
    """An entry is held out of vLLM's LRU (within OBCACHE_ENTRY_POOL_SHARE of the pool): it
    survives unrelated prompts that cycle the whole pool; a running request that needs its
    blocks gets them before anyone is preempted; released, it dies cleanly under the LRU."""
    engine = fresh
    prefix = engine.scheduler.obcache_prefix
    doc, (q1, q2) = _doc(tokenizer, sentences=12), _questions(tokenizer)
    kv = {"kv_budget": 96, "kv_compress_at": len(doc), "kv_pipeline": "tova"}
    _generate(engine, doc + q1, kv)
    entry = next(iter(prefix.entries))
    assert prefix.held_blocks == len(entry.block_ids) and entry.entry_id in prefix.held
    unrelated = [_doc(tokenizer, sentences=60, seed=seed) for seed in range(2)]
    for prompt in unrelated:  # together more blocks than the pool: every free block reused
        _generate(engine, prompt, max_tokens=1)
    assert prefix.valid(entry)
    _, cached, usage, _ = _generate(engine, doc + q2, kv)
    assert cached == len(doc) and usage["reused_tokens"] == len(doc)
    # Two requests that fit the pool only with the entry's blocks: admitted (their prompts
    # fit beside it), they outgrow the rest while decoding; the entry gives way, nobody is
    # preempted.
    from vllm import SamplingParams

    free = engine.pool.get_num_free_blocks()
    need = (POOL_BLOCKS - 1 - len(entry.block_ids) // 2) // 2 * BS  # tokens each at the end
    new_tokens = 3 * BS
    assert 2 * (need - new_tokens) // BS < free < 2 * need // BS <= POOL_BLOCKS - 1
    prompts = [_doc(tokenizer, sentences=60, seed=10 + i)[: need - new_tokens] for i in (0, 1)]
    with _counting_preemptions(engine) as preempted:
        params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        outs = engine.llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                   use_tqdm=False)  # fmt: skip
    assert [len(o.outputs[0].token_ids) for o in outs] == [new_tokens, new_tokens]
    assert preempted == [] and entry.entry_id not in prefix.held
    assert prefix.counts[("compress_at", "released")] >= 1
    for prompt in unrelated:  # released: the LRU may reuse its blocks, and does
        _generate(engine, prompt, max_tokens=1)
    assert not prefix.valid(entry)
    tokens, cached, usage, _ = _generate(engine, doc + q2, kv)
    assert "reused_tokens" not in usage and usage["evictions"] == 1  # recomputed
    assert prefix.counts[("compress_at", "evicted")] >= 1


def test_kv_events_tell_the_truth(fresh, tokenizer, kv_events):
    """A subscriber's view of the cache (BlockStored minus BlockRemoved since the last
    AllBlocksCleared) is exactly the token-addressable blocks in the pool; entry tags are
    never published."""
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
    from vllm.v1.core.kv_cache_utils import get_block_hash, maybe_convert_block_hash

    from obcache_vllm.eviction.entries import is_tag, tag

    engine = fresh
    events = kv_events.wait_for(lambda ev: any(isinstance(e, AllBlocksCleared) for e in ev))
    cleared = len(events)
    doc, (q1, q2) = _doc(tokenizer), _questions(tokenizer)
    _generate(engine, doc + q1, {"kv_budget": 0.25, "kv_compress_at": len(doc)})
    _generate(engine, doc + q2, {"kv_budget": 0.25, "kv_compress_at": len(doc)})
    _generate(engine, doc + q2, {"kv_budget": 0.25, "kv_pipeline": "tova"})
    pool = engine.pool
    assert any(is_tag(key) for key in pool.cached_block_hash_to_block._cache)  # an entry
    for seed in range(3):  # LRU pressure: entry blocks and registered blocks are reused
        _generate(engine, _doc(tokenizer, sentences=60, seed=seed), max_tokens=1)
    keys = list(pool.cached_block_hash_to_block._cache)
    # As published (vLLM may publish int hashes: VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES).
    expected = {maybe_convert_block_hash(get_block_hash(k)) for k in keys if not is_tag(k)}

    def view(evs):
        stored = set()
        for e in evs[cleared:]:
            if isinstance(e, AllBlocksCleared):
                stored.clear()
            elif isinstance(e, BlockStored):
                stored.update(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                stored.difference_update(e.block_hashes)
        return stored

    events = kv_events.wait_for(lambda ev: view(ev) == expected)
    assert view(events) == expected and expected
    published = {h for e in events for h in getattr(e, "block_hashes", [])}
    made = engine.scheduler.obcache_prefix.entries._next_id
    tags = {maybe_convert_block_hash(tag(i, j)) for i in range(made) for j in range(64)}
    assert not published & tags
    before = len(events)
    assert engine.llm.reset_prefix_cache()
    assert len(engine.scheduler.obcache_prefix.entries) == 0  # the index follows the reset
    _generate(engine, q1, max_tokens=1)  # vLLM publishes the clear with the next step
    events = kv_events.wait_for(lambda ev: any(isinstance(e, AllBlocksCleared)
                                               for e in ev[before:]))  # fmt: skip
    assert any(isinstance(e, AllBlocksCleared) for e in events[before:])


def test_compaction_never_writes_a_block_another_request_reads(fresh, driver, tokenizer, stock):
    """A stock request that holds the document's blocks runs while a budgeted one reads them
    and compacts: the stock one keeps stock vLLM's tokens (copy-on-write at admission)."""
    engine = fresh
    doc, (q1, q2) = _doc(tokenizer), _questions(tokenizer)
    failures = dict(engine.scheduler.obcache_totals.failures)
    stock_id = driver.add("holder", doc + q1, 24, ignore_eos=True)
    for _ in range(3):  # the holder's prompt is cached, it decodes on
        driver.step()
    reader = driver.add("reader", doc + q2, 8, kv_budget=0.25, kv_pipeline="tova")
    out = driver.run()
    held = max(s[reader].computed for s in driver.trace if reader in s)
    assert held >= len(doc + q2)
    assert out[stock_id] == stock["holder"]
    # The reader read the holder's blocks, copied those it compacts and compacted: without
    # the copies its compaction is refused (a contained fault) and it runs uncompressed.
    (record,) = [r for r in engine.scheduler.obcache_finished if r.req_id == reader]
    assert record.evictions == 1 and record.blocks_freed >= 1
    assert dict(engine.scheduler.obcache_totals.failures) == failures


def test_a_failed_adoption_falls_back_to_a_recompute(fresh, tokenizer):
    engine = fresh
    doc, (q1, q2) = _doc(tokenizer), _questions(tokenizer)
    kv = {"kv_budget": 0.25, "kv_compress_at": len(doc), "kv_pipeline": "tova"}
    _generate(engine, doc + q1, kv)
    failures = dict(engine.scheduler.obcache_totals.failures)
    tokens, cached, usage, _ = _generate(engine, doc + q2, {**kv, "obcache_fault": "adopt"})
    assert cached == 0 and usage["evictions"] == 1 and "reused_tokens" not in usage
    assert engine.scheduler.obcache_totals.failures[("adopt", "injected")] == (
        failures.get(("adopt", "injected"), 0) + 1
    )
    again, _, usage_again, _ = _generate(engine, doc + q2, kv)
    assert usage_again["reused_tokens"] == len(doc) and again == tokens


def test_auto_compresses_the_shared_document_once_offline(fresh, tokenizer):
    """``kv_compress_at: "auto"`` through the offline engine's admission: the first question
    over a document compresses all of its prompt but the last token, the second the
    document's shared blocks (an entry is made); each question asked again compresses where
    it was compressed the first time and adopts that entry (the first's: its own compressed
    prompt, left on its session entry's blocks), with its first answer, which is also what a
    recompute at the same point gives."""
    doc, questions = _doc(tokenizer, seed=47), _questions(tokenizer)
    kv = {"kv_budget": 0.25, "kv_pipeline": "tova", "kv_compress_at": "auto"}
    first_tokens, _, first, _ = _generate(fresh, doc + questions[0], kv)
    whole = len(doc + questions[0]) - 1
    assert first["compress_at"] == whole and "reused_tokens" not in first
    second_tokens, _, second, _ = _generate(fresh, doc + questions[1], kv)
    common = next(i for i, (a, b) in enumerate(zip(*questions, strict=False)) if a != b)
    point = (len(doc) + common) // BS * BS  # the whole blocks both prompts share
    assert second["compress_at"] == point and "reused_tokens" not in second
    third_tokens, _, third, _ = _generate(fresh, doc + questions[0], kv)
    assert third["compress_at"] == whole and third["reused_tokens"] == whole
    assert third["reused_from"] == "compress_at" and third_tokens == first_tokens
    fourth_tokens, _, fourth, _ = _generate(fresh, doc + questions[1], kv)
    assert fourth["compress_at"] == point and fourth["reused_tokens"] == point
    assert fourth_tokens == second_tokens
    assert fresh.llm.reset_prefix_cache()
    for prompt, at, tokens in ((doc + questions[1], point, fourth_tokens),
                               (doc + questions[0], whole, third_tokens)):  # fmt: skip
        again, _, usage, _ = _generate(fresh, prompt, {**kv, "kv_compress_at": at})
        assert "reused_tokens" not in usage and again == tokens


def test_auto_leaves_a_tentative_session_that_a_next_turn_continues(fresh, tokenizer):
    """``kv_compress_at: "auto"`` on a prompt that shares nothing: compressed whole but its
    last token (the tokens ``kv_compress_at`` at that point gives), as a tentative session, so
    a chat's second turn already continues its cache, and unread tentative entries never keep
    a waiting request waiting: within the base share they give way, and nobody is
    preempted."""
    engine, prefix = fresh, fresh.scheduler.obcache_prefix
    kv = {"kv_budget": 0.25, "kv_pipeline": "tova", "kv_compress_at": "auto"}
    turn1 = _doc(tokenizer, seed=43) + _questions(tokenizer)[0]
    share = prefix.held.limit, prefix.held.base
    try:
        tokens1, _, usage1, _ = _generate(engine, turn1, kv, max_tokens=12)
        # all but its last token (a repeat would adopt it), nothing reused
        assert usage1["compress_at"] == len(turn1) - 1 and "reused_tokens" not in usage1
        (entry_id,) = prefix.held._held
        assert prefix.held.is_tentative(entry_id)
        turn2 = turn1 + tokens1 + _questions(tokenizer)[1]
        tokens2, _, usage2, _ = _generate(engine, turn2, kv, max_tokens=12)
        assert usage2["session_turn"] == 2 and usage2["reused_from"] == "session"
        assert not any(prefix.held.is_tentative(e) for e in prefix.held._held)  # adopted
        prefix.release_all()
        assert engine.llm.reset_prefix_cache()
        # the first turn is what compressing at the same point gives
        explicit = {"kv_budget": 0.25, "kv_pipeline": "tova", "kv_compress_at": len(turn1) - 1}
        assert _generate(engine, turn1, explicit, max_tokens=12)[0] == tokens1
        prefix.release_all()
        assert engine.llm.reset_prefix_cache()
        # Five entries: raise the share so that all are held (and within it: only their being
        # tentative makes them give way).
        prefix.held.limit = prefix.held.base = int(0.75 * (POOL_BLOCKS - 1))
        _tentative_gives_way(engine, prefix, tokenizer, kv)
    finally:
        prefix.release_all()
        prefix.held.limit, prefix.held.base = share


def _tentative_gives_way(engine, prefix, tokenizer, kv):
    for seed in range(80, 85):  # unique documents: tentative entries, within the share
        _generate(engine, _doc(tokenizer, sentences=33, seed=seed)[:1000], kv)
    assert len(prefix.held) == 5 and prefix.held.blocks <= prefix.held.base
    assert prefix.held_surplus == prefix.held.blocks > 3
    _long_beside_short(engine, tokenizer)
    assert prefix.counts.get(("session", "released"), 0) >= 1


def _long_beside_short(engine, tokenizer):
    """A short request runs while a long one waits for 3 blocks more than are free beside it:
    the long one must run beside it (no preemption), and each gets its tokens alone."""
    from support.engine import Driver

    free = engine.pool.get_num_free_blocks()
    short_prompt = _doc(tokenizer, sentences=8, seed=90)[:200]  # 7 blocks, then it grows
    long_len = (free - 7 + 3) * BS - 1  # 3 blocks more than are free beside the short one
    long_prompt = _doc(tokenizer, sentences=50, seed=91)[:long_len]
    assert len(long_prompt) == long_len < 2048 - 8
    driver = Driver(engine)
    with _counting_preemptions(engine) as preempted:
        a = driver.add("short", short_prompt, 96, ignore_eos=True)
        b = driver.add("long", long_prompt, 4, ignore_eos=True)
        outputs = driver.run()
    assert driver.max_running == 2 and preempted == []  # the long one ran beside the short one
    # unbudgeted requests: each alone gives the same tokens (stock parity: tests/vllm/)
    assert outputs[a] == _generate(engine, short_prompt, max_tokens=96, ignore_eos=True)[0]
    assert outputs[b] == _generate(engine, long_prompt, max_tokens=4, ignore_eos=True)[0]


def test_holds_above_the_base_share_give_way_to_a_waiting_request(fresh, tokenizer):
    """Entries are held up to OBCACHE_ENTRY_POOL_SHARE_MAX of the pool while nobody waits; a
    request that waits for blocks while another runs takes the holds above
    OBCACHE_ENTRY_POOL_SHARE (least recently used first) and runs beside it, instead of
    waiting for it to finish. Nobody is preempted, and each gets its tokens alone."""
    engine = fresh
    prefix = engine.scheduler.obcache_prefix
    # OBCACHE_ENTRY_POOL_SHARE_MAX=0.75 (the session engine runs with the default: none)
    limit, prefix.held.limit = prefix.held.limit, int(0.75 * (POOL_BLOCKS - 1))
    try:
        _surplus_gives_way(engine, prefix, tokenizer)
    finally:
        prefix.release_all()
        prefix.held.limit = limit


def _surplus_gives_way(engine, prefix, tokenizer):
    docs = [_doc(tokenizer, sentences=33, seed=70 + i)[:1000] for i in range(5)]
    for doc in docs:  # five entries of ~11 blocks: more than the base share (23 blocks)
        _generate(engine, doc + _questions(tokenizer)[0],
                  {"kv_budget": 320, "kv_compress_at": len(doc), "kv_pipeline": "tova"})
    assert len(prefix.held) == 5 and prefix.held.blocks > prefix.held.base
    assert prefix.held_surplus > 3
    _long_beside_short(engine, tokenizer)
    assert prefix.counts[("compress_at", "released")] >= 1
    assert prefix.held.blocks >= prefix.held.base  # only the surplus gave way


def test_a_new_documents_entry_takes_the_room_of_entries_no_one_reads(fresh, tokenizer):
    """Documents compressed as little as 1,000 tokens to 900 leave entries of 29 blocks; right
    after its compaction, a document's request holds its own blocks and the spare blocks its
    stock KV is being copied aside into, so the next document's copy finds too few free
    blocks while an earlier, never-read entry is held. The copy takes the room of the held
    entries that rank before a new one (never read: least recently used first) instead of
    being skipped, and a question over the newest document adopts its entry (before, the
    copy was skipped while the unread entry stayed held, and the question compressed the
    document again)."""
    from obcache_vllm.eviction.entries import HeldEntries

    engine = fresh
    prefix = engine.scheduler.obcache_prefix
    # A HeldEntries of its own: nothing measured (the shared engine's earlier reads set the
    # prediction a new entry is ranked by), held up to 3/4 of the pool
    shared = prefix.held
    prefix.held = HeldEntries(int(0.75 * (POOL_BLOCKS - 1)), base=shared.base)
    short, make_room = [], prefix._make_room
    prefix._make_room = lambda n: short.append(n) or make_room(n)
    try:

        def count(what):
            return prefix.counts.get(("compress_at", what), 0)

        created, released = count("created"), count("released")
        kv = {"kv_budget": 900, "kv_pipeline": "tova"}
        docs = [_doc(tokenizer, sentences=33, seed=90 + i)[:1000] for i in range(3)]
        q1, q2 = _questions(tokenizer)
        for i, doc in enumerate(docs):
            _, _, first, _ = _generate(engine, doc + q1, {**kv, "kv_compress_at": len(doc)})
            assert "reused_from" not in first and first["evictions"] == 1
            assert count("created") == created + i + 1  # every document leaves its entry
            assert len(short) == i and all(n > 0 for n in short)  # short from the second on
        assert count("released") >= released + 2 and len(prefix.held) == 1
        held = [e.entry_id for e in prefix.entries if e.entry_id in prefix.held]
        assert held == [max(e.entry_id for e in prefix.entries)]  # the newest document's
        doc = docs[2]
        _, cached, usage, _ = _generate(engine, doc + q2, {**kv, "kv_compress_at": len(doc)})
        assert usage.get("reused_from") == "compress_at" and usage["reused_tokens"] == len(doc)
    finally:
        del prefix._make_room
        prefix.release_all()
        prefix.held = shared
