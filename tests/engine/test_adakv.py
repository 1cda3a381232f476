"""AdaKV with per-head memory on the real engine (``kv_pipeline: adakv``).

* **Exact**: every layer and KV head keeps exactly the entries the HF reference's own
  selection keeps (:func:`~obcache_vllm.evidence.head_budgets.served_masks`, the same scores
  and block rule), and the greedy tokens are the argmax of the HF model attending over those
  entries only (``-inf`` on the rest, :func:`~obcache_vllm.evidence.head_budgets.forced_logits`)
  at every position: query-aware and query-agnostic (``kv_compress_at``), in one batch with
  stock and uniform requests, whose tokens equal their own runs alone (their reads go through
  the per-head tables too while an adakv row is in the batch).
* **Memory**: the blocks an adakv request holds in vLLM's pool follow the SUM of its heads'
  kept tokens: the same blocks as uniform snapkv at the same budget, while its largest head
  keeps more tokens than those blocks could hold in one table for every head.
* **Shared state**: preempted after its per-head eviction, it is recomputed and evicted
  again to the same tokens; at the pool's limit, with differently budgeted copies of one
  prompt in the same steps, an abort and queued requests, every output equals that request
  alone and every block goes back to the pool.
"""

from __future__ import annotations

import time

import pytest
import torch
from support.engine import POOL_BLOCKS
from support.texts import needle_parts, needle_prompt

from obcache_vllm.admission import parse_kv_options
from obcache_vllm.evidence import head_budgets as hb
from obcache_vllm.evidence import hf_reference as ref

pytestmark = [pytest.mark.engine, pytest.mark.timeout(1500)]

BS, BUDGET, NEW = 32, 128, 16
ADA = {"kv_budget": BUDGET, "kv_pipeline": "adakv"}


def _layer(name: str) -> int:
    return int(name.split("layers.")[1].split(".")[0])


def _generate(engine, prompts, extras, max_tokens=NEW):
    """Greedy tokens and the worker's records of each request, all in one batch."""
    return [(tokens, record) for tokens, _, record in _turn(engine, prompts, extras, max_tokens)]


def _kept_masks(record, length: int) -> dict[int, torch.Tensor]:
    return {_layer(name): hb.positions_mask(kept, length)
            for name, kept in record.items() if name.endswith(":positions")}  # fmt: skip


@pytest.fixture(scope="module")
def cases(tokenizer):
    """Three query-aware prompts (769-951 tokens), one query-agnostic (compressed where the
    question starts), and the first again with an 8-query window and ``attn``."""
    aware = [tokenizer(needle_prompt(24 + 3 * i, seed=i)[0]).input_ids for i in range(3)]
    context, question, _ = needle_parts(26, seed=5)
    ctx = tokenizer(context).input_ids
    agnostic = ctx + tokenizer(question).input_ids
    return [(ids, dict(ADA)) for ids in aware] + [
        (agnostic, {**ADA, "kv_compress_at": len(ctx)}),
        (aware[0], {**ADA, "kv_window": 8, "kv_scorer": "attn"}),  # another window and score
    ]


@pytest.fixture(scope="module")
def hf_model(model_path):
    model, _ = ref.load_model(model_path, dtype=torch.float32)
    return model


def test_adakv_keeps_the_references_entries_and_generates_its_tokens(engine, cases, hf_model):
    stock_ids, snap = cases[0][0], {"kv_budget": BUDGET, "kv_pipeline": "snapkv"}
    alone = [_generate(engine, [stock_ids], [extra])[0][0] for extra in (None, snap)]
    prompts = [ids for ids, _ in cases] + [stock_ids, stock_ids]
    mixed = _generate(engine, prompts, [extra for _, extra in cases] + [None, snap])
    # Unbudgeted and uniform rows read through the per-head tables in this batch: unchanged.
    assert [tokens for tokens, _ in mixed[-2:]] == alone

    for (ids, extra), (tokens, record) in zip(cases, mixed, strict=False):
        options = parse_kv_options(extra, len(ids))
        point = options.compress_point(len(ids))
        state = ref.prefill(hf_model, torch.tensor(ids[:point]), query_window=-1)
        want = hb.served_masks(state, options, BS)
        got = _kept_masks(record, point)
        assert sorted(got) == list(range(len(want))) and want, "every layer evicted"
        for layer, mask in want.items():
            assert got[layer].equal(mask), f"layer {layer}: kept entries differ"
            counts = mask.sum(1)
            assert int(counts.sum()) == 3 * (point - (point - BUDGET) // BS * BS)  # uniform total
        assert len({tuple(m.sum(1).tolist()) for m in want.values()}) > 1  # spread per layer
        rest = torch.tensor(ids[point:]) if point < len(ids) else None
        logits = hb.forced_logits(hf_model, state, got, tokens, rest=rest)
        assert logits.argmax(-1).tolist() == tokens, "vLLM's tokens are the masked argmax"


def _held_once_evicted(driver, rids) -> dict[str, list[tuple[int, int]]]:
    """Run the driver to the end; per request, (tokens computed, blocks held in vLLM's pool)
    after every step from its first eviction on."""
    engine, sched = driver.engine, driver.engine.scheduler
    held = {rid: [] for rid in rids}
    while engine.llm.llm_engine.has_unfinished_requests():
        driver.step()
        for rid in held:
            if rid in sched.requests and sched.obcache_states[rid].dead:
                held[rid].append((sched.requests[rid].num_computed_tokens,
                                  engine.live_blocks(rid)))  # fmt: skip
    return held


def test_adakv_blocks_follow_the_sum_of_its_heads_kept_tokens(driver, cases):
    engine, ids = driver.engine, cases[2][0]
    ada = driver.add("sum-ada", ids, 40, ignore_eos=True, **ADA)
    snap = driver.add("sum-snap", ids, 40, ignore_eos=True, kv_budget=BUDGET,
                      kv_pipeline="snapkv")  # fmt: skip
    held = _held_once_evicted(driver, (ada, snap))
    assert held[ada] and held[ada] == held[snap], "adakv holds what uniform snapkv holds"
    record = engine.runner.obcache.records[ada]
    masks = _kept_masks(record, len(ids))
    computed, blocks = held[ada][0]
    widest = max(int(m.sum(1).max()) for m in masks.values())
    for mask in masks.values():
        # The layer's kept tokens, with the decode tokens written since, fit its blocks.
        assert int(mask.sum()) + 3 * (computed - len(ids)) <= 3 * blocks * BS
    # One table for every head would need the largest head's count in every head.
    assert widest > blocks * BS
    assert driver.outputs[ada] and len(driver.outputs[ada]) == 40
    assert engine.free_blocks() == POOL_BLOCKS - 1


def test_adakv_preempted_after_its_eviction_is_recomputed_to_the_same_tokens(driver, cases):
    engine, ids = driver.engine, cases[1][0]
    sched = engine.scheduler
    first = driver.add("ada-once", ids, 24, ignore_eos=True, **ADA)
    driver.run()
    rid = driver.add("ada-preempted", ids, 24, ignore_eos=True, **ADA)
    while len(sched.requests[rid].output_token_ids) < 6:
        driver.step()
    assert engine.runner.obcache.states[rid].head_layout is not None
    request = sched.requests[rid]
    sched.running.remove(request)
    sched._preempt_request(request, time.monotonic())  # what vLLM does under memory pressure
    out = driver.run()
    assert out[rid] == out[first]
    assert sched.obcache_finished[-1].evictions == 2  # evicted again after the recompute
    assert engine.free_blocks() == POOL_BLOCKS - 1


def _all_at_once_with_the_last_aborted(driver, plan, new: int, abort_after: int) -> None:
    """``plan``: (name, prompt, kv fields) of requests sent at once, the last one aborted after
    ``abort_after`` steps. Each of the others equals its run alone, they ran in flight
    together (some queued), and every block goes back to the pool."""
    engine = driver.engine
    alone = {name: _generate(engine, [prompt], [extra], max_tokens=new)[0][0]
             for name, prompt, extra in plan[:-1]}  # fmt: skip
    rid = {name: driver.add(name, prompt, new, ignore_eos=True, **(extra or {}))
           for name, prompt, extra in plan}  # fmt: skip
    for _ in range(abort_after):
        driver.step()
    gone = plan[-1][0]
    engine.llm.llm_engine.abort_request([gone])
    out = driver.run()
    assert max(len(step) for step in driver.trace) >= 6  # in flight together, some queued
    for name, _, _ in plan[:-1]:
        assert out[rid[name]] == alone[name], name
    assert len(out.get(rid[gone], [])) < new
    assert engine.free_blocks() == POOL_BLOCKS - 1


def test_adakv_at_the_pools_limit_with_other_budgets_of_one_prompt_and_an_abort(driver, cases):
    """Eight requests at once over a 96-block pool (three prompts of 769-951 tokens: about
    three fit uncompressed), two adakv budgets and snapkv on the same prompt, stock ones, one
    aborted mid-way; each output equals its run alone."""
    ids = [ids for ids, _ in cases[:3]]
    # Request ids of their own: other tests find their requests by id prefix in the
    # scheduler's finished records, which outlive a test.
    plan = [
        ("limit-ada0", ids[0], ADA), ("limit-ada0-96", ids[0], {**ADA, "kv_budget": 96}),
        ("limit-snap0", ids[0], {"kv_budget": BUDGET}), ("limit-stock0", ids[0], None),
        ("limit-ada1", ids[1], ADA), ("limit-stock1", ids[1], None),
        ("limit-ada2", ids[2], ADA), ("limit-gone", ids[2], ADA),
    ]  # fmt: skip
    _all_at_once_with_the_last_aborted(driver, plan, 24, abort_after=6)


@pytest.mark.parametrize(("fault", "fate"), [("score", "length"), ("compact:5", "error")],
                         ids=["scoring-raises", "compaction-torn-at-layer-5"])  # fmt: skip
def test_a_fault_in_adakvs_eviction_degrades_only_its_request(engine, cases, fault, fate):
    """An injected fault (OBCACHE_VLLM_FAULTS=1, engine conftest) while an adakv request is
    scored (nothing written: it goes on as stock) or written (layer 5 of 30: torn, finished
    with an error); its neighbours, an adakv and a stock request, are as alone."""
    ids = [ids for ids, _ in cases[:3]]
    alone = [_generate(engine, [ids[i]], [extra])[0][0] for i, extra in ((1, ADA), (2, None))]
    stock_faulty = _generate(engine, [ids[0]], [None])[0][0]
    totals = engine.scheduler.obcache_totals
    before = sum(totals.failures.values())
    from vllm import SamplingParams

    extras = [{**ADA, "obcache_fault": fault}, ADA, None]
    params = [SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, extra_args=extra)
              for extra in extras]  # fmt: skip
    outs = engine.llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in outs]
    assert got[1:] == alone
    assert outs[0].outputs[0].finish_reason == fate
    if fate == "length":
        assert got[0] == stock_faulty  # uncompressed from the fault on: stock
    else:
        assert len(got[0]) < NEW
    assert sum(totals.failures.values()) == before + 1
    assert engine.free_blocks() == POOL_BLOCKS - 1


# -- kv_decode: the per-head layout evicted again as decoding fills the budget -----------------
DECODE_NEW = 72  # two decode-time orders after the prompt's (one per 32 tokens past the budget)


def _decode_cases(cases):
    """Query-aware with the default window, the 8-query window with ``attn`` (both summed
    decode scores), ``random`` (query-free: replaced at each scoring, "last"), and
    query-agnostic (the prompt's end seeds the decode scores on the per-head layout its
    compress point left). Not ``key_norm``: in layer 0 a key's norm is its token's whatever
    its position (RoPE rotates), so repeated tokens tie exactly, and vLLM's and HF's float
    noise break those ties differently (seen at the prompt's order, before any decode). The
    query-agnostic case uses ``obcache_joint``: with ``obcache_key`` its layer 3 has a plateau
    of scores equal to 1e-7 (0.07245 over dozens of entries, max-pooled), and one entry per
    head swaps at the boundary at the first decode order (2 of 90 heads; tokens still equal);
    ``attn`` and ``obcache_joint`` match exactly at all three decode orders."""
    aware, agnostic = cases[0][0], cases[3]
    decode = {**ADA, "kv_decode": True}
    return [
        (aware, decode),
        (cases[1][0], {**decode, "kv_window": 8, "kv_scorer": "attn"}),
        (cases[2][0], {**decode, "kv_scorer": "random"}),
        (agnostic[0], {**agnostic[1], "kv_decode": True, "kv_scorer": "obcache_joint"}),
    ]


def test_adakv_with_kv_decode_follows_the_reference_order_by_order(engine, cases, hf_model):
    """Every decode-time order re-selects each KV head over its own entries (AdaKV's rule over
    uneven counts): at each order, every layer and head keeps exactly the positions the HF
    reference keeps (:func:`~obcache_vllm.evidence.head_budgets.run_evicting_heads`, attention
    masked per head over the whole cache), and the greedy tokens are the reference's. In one
    batch with a stock request and uniform snapkv with ``kv_decode`` on the same prompt, whose
    tokens equal their runs alone."""
    decode_cases = _decode_cases(cases)
    stock_ids = decode_cases[0][0]
    snap = {"kv_budget": BUDGET, "kv_pipeline": "snapkv", "kv_decode": True}
    alone = [_generate(engine, [stock_ids], [extra], DECODE_NEW)[0][0] for extra in (None, snap)]
    prompts = [ids for ids, _ in decode_cases] + [stock_ids, stock_ids]
    mixed = _generate(engine, prompts, [extra for _, extra in decode_cases] + [None, snap],
                      DECODE_NEW)  # fmt: skip
    assert [tokens for tokens, _ in mixed[-2:]] == alone

    for (ids, extra), (tokens, record) in zip(decode_cases, mixed, strict=False):
        options = parse_kv_options(extra, len(ids))
        run = hb.run_evicting_heads(hf_model, torch.tensor(ids), options, BS, DECODE_NEW)
        assert record[":orders"] == run.orders, extra
        assert sum(not prefill for _, prefill in run.orders) >= 2, "decode-time orders"
        positions = {_layer(name): kept for name, kept in record.items()
                     if name.endswith(":positions")}  # fmt: skip
        assert sorted(positions) == sorted(run.kept)
        for layer, want in run.kept.items():
            got = positions[layer]
            assert [g.tolist() for g in got] == [w.tolist() for w in want], (extra, layer)
        widths = {tuple(len(p) for p in kept) for kept in run.kept.values()}
        if options.scorer != "random":  # random scores spread evenly, to whole head-blocks
            assert len(widths) > 1, "the heads' counts differ across layers after decode"
        assert tokens == run.token_ids, extra


def test_adakv_with_kv_decode_preempted_follows_the_recompute(driver, cases, hf_model):
    """Preempted after a decode-time order, the request is recomputed from its tokens: the
    prompt evicted at its end, the output so far one segment of decode-time queries with the
    block rule's order at its end, then decoding on. Its tokens after the preemption are the
    HF reference's following that recompute (``run_evicting_heads(..., prompt_len=)``)."""
    engine, ids = driver.engine, cases[1][0]
    sched = engine.scheduler
    decode = {**ADA, "kv_decode": True}
    rid = driver.add("ada-decode-preempted", ids, 60, ignore_eos=True, **decode)
    state = None
    for _ in range(200):  # until the prompt's order and one at decode
        driver.step()
        state = engine.runner.obcache.states.get(rid)
        if state is not None and state.evictions >= 2:
            break
    assert state is not None and state.evictions == 2 and state.disabled is None
    request = sched.requests[rid]
    done = len(request.output_token_ids)
    sched.running.remove(request)
    sched._preempt_request(request, time.monotonic())
    out = driver.run()[rid]
    options = parse_kv_options(decode, len(ids))
    before = hb.run_evicting_heads(hf_model, torch.tensor(ids), options, BS, done)
    assert out[:done] == before.token_ids
    after = hb.run_evicting_heads(hf_model, torch.tensor(ids + out[:done]), options, BS,
                                  60 - done, prompt_len=len(ids))  # fmt: skip
    assert after.orders[1] == (len(ids) + done, False)  # the recomputed output's order
    assert out[done:] == after.token_ids
    assert engine.free_blocks() == POOL_BLOCKS - 1


def test_adakv_with_kv_decode_holds_what_snapkv_with_kv_decode_holds(driver, cases):
    """Decoding 96 tokens (three decode-time orders), an adakv request holds exactly the blocks
    snapkv holds at the same budget, step by step (two requests on one prompt, side by side:
    the same block rule frees the same blocks)."""
    engine, ids = driver.engine, cases[0][0]
    decode = {**ADA, "kv_decode": True}
    ada = driver.add("dec-sum-ada", ids, 96, ignore_eos=True, **decode)
    snap = driver.add("dec-sum-snap", ids, 96, ignore_eos=True,
                      **{**decode, "kv_pipeline": "snapkv"})  # fmt: skip
    held = _held_once_evicted(driver, (ada, snap))
    assert held[ada] and held[ada] == held[snap], "adakv holds what uniform snapkv holds"
    assert engine.runner.obcache.records[ada][":orders"][-1][0] > len(ids) + 64
    assert engine.free_blocks() == POOL_BLOCKS - 1


def test_adakv_with_kv_decode_at_the_pools_limit_with_an_abort(driver, cases):
    """Eight requests at once over the 96-block pool, decoding 96 tokens: adakv with
    ``kv_decode`` at two budgets, snapkv with ``kv_decode`` at the same budget on the same
    prompt, stock requests, adakv without ``kv_decode``, one aborted mid-way. Every output
    equals its run alone and every block goes back to the pool. (Which of them the pool runs
    first, or preempts, depends on what the prefix cache holds, so blocks are compared in the
    test above, not here.)"""
    ids = [ids for ids, _ in cases[:3]]
    decode = {**ADA, "kv_decode": True}
    plan = [
        ("dec-ada0", ids[0], decode), ("dec-snap0", ids[0], {**decode, "kv_pipeline": "snapkv"}),
        ("dec-ada0-96", ids[0], {**decode, "kv_budget": 96}), ("dec-stock0", ids[0], None),
        ("dec-ada1", ids[1], decode), ("dec-once1", ids[1], ADA),
        ("dec-stock2", ids[2], None), ("dec-gone", ids[2], decode),
    ]  # fmt: skip
    _all_at_once_with_the_last_aborted(driver, plan, 96, abort_after=8)


# -- sessions: the per-head layout continued turn after turn -------------------------------------
def _turn(engine, prompts, extras, max_tokens=12):
    """Greedy tokens, ``usage.obcache`` and the worker's record of each request, one batch."""
    from vllm import SamplingParams

    records = engine.runner.obcache.records
    before = set(records)
    params = [SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                             extra_args=extra) for extra in extras]  # fmt: skip
    outs = engine.llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)  # fmt: skip
    by_id = {rid.rsplit("-", 1)[0]: records[rid] for rid in records if rid not in before}
    return [(list(o.outputs[0].token_ids), (o.kv_transfer_params or {}).get("obcache"),
             by_id.get(o.request_id)) for o in outs]  # fmt: skip


def test_adakv_sessions_continue_the_per_head_layout_as_the_reference(engine, cases, hf_model,
                                                                        tokenizer):  # fmt: skip
    """``kv_session`` with adakv: each turn's final cache, laid out per head, is left as a
    session entry that carries its per-head counts; the next turn adopts it, its worker reads
    and re-selects each head over its own entries at the new prompt's end. Two conversations
    of three turns in flight together beside a stock request: each turn exactly the HF
    reference continuing its own per-head cache (``start=``), the same kept indices per layer
    and head at its order and the same tokens; the stock request gives its tokens alone."""
    kv = {**ADA, "kv_session": True}
    prompts, stock_ids = [cases[0][0], cases[1][0]], cases[2][0]
    stock_alone = _turn(engine, [stock_ids], [None], 24)[0][0]
    previous = [None, None]
    for turn in range(3):
        *chats, (stock, _, _) = _turn(engine, [*prompts, stock_ids], [kv, kv, None], 24)
        assert stock == stock_alone
        for c, (out, usage, record) in enumerate(chats):
            prompt = prompts[c]
            if turn:
                assert usage["reused_from"] == "session", usage
                assert usage["session_turn"] == turn + 1, usage
            options = parse_kv_options(kv, len(prompt))
            run = hb.run_evicting_heads(hf_model, torch.tensor(prompt), options, BS, 24,
                                        start=previous[c])  # fmt: skip
            assert run.orders == [(len(prompt), True)], run.orders  # each turn evicts at its end
            for layer, want in run.indices.items():
                got = record[f"model.layers.{layer}.self_attn.attn"]
                assert [g.tolist() for g in got] == [w.tolist() for w in want], (c, turn, layer)
            assert out == run.token_ids, (c, turn)
            counts = {tuple(len(p) for p in kept) for kept in run.kept.values()}
            assert len(counts) > 1  # the heads keep different counts, layer by layer
            previous[c] = run
            prompts[c] = prompt + out + tokenizer(
                f" Question {turn}: which code was named in the document above, and where?"
            ).input_ids
