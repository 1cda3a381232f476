"""Independent oracles where reuse and preemption were only compared with the plugin itself.

* A ``kv_session`` turn equals the HF reference (:mod:`obcache_vllm.evidence.hf_reference`)
  continuing the previous turn's kept cache with the new suffix at its true positions: the
  reference keeps its own cache from turn to turn, vLLM adopts the entry the last turn left.
* Budgeted requests that vLLM preempts because the pool runs short (real pressure: more
  requests than the pool holds, not a call to the scheduler) equal the same request run
  alone: preempted, a request recomputes its prompt and its output from the tokens, evicts
  again at its compress point, and goes on as if nothing happened. With ``kv_decode`` they
  equal the HF reference following the recompute (its decode-time evictions are not
  replayed: the output so far is recomputed in one piece and evicted once).

(``kv_when: "pressure"`` against a stock engine and the HF reference: test_pressure.py.)
"""

from __future__ import annotations

import pytest
import torch
from support.engine import POOL_BLOCKS, generate, record_preemptions
from support.texts import haystack

from obcache_vllm.admission import parse_kv_options

BS = 32


@pytest.fixture(scope="module")
def hf_model(model_path):
    from obcache_vllm.evidence import hf_reference as ref

    model, _ = ref.load_model(model_path)
    return model


@pytest.fixture
def fresh(engine):
    assert engine.llm.reset_prefix_cache()
    yield engine
    assert engine.free_blocks() == POOL_BLOCKS - 1


SESSION = {"kv_budget": 160, "kv_session": True, "kv_pipeline": "tova"}


@pytest.mark.parametrize("seed", [101, 102])
def test_a_session_turn_equals_the_reference_continuing_its_kept_cache(
    fresh, hf_model, tokenizer, seed
):
    """Turn 1 compresses a ~450-token prompt to 160 (+ block rounding) and answers; turn 2
    sends turn 1's prompt, its whole answer and a question. vLLM continues the entry turn 1
    left (its prompt and answer but the last token); the reference continues its own cache."""
    from obcache_vllm.evidence import hf_reference as ref

    first = tokenizer(haystack(14, seed=seed)).input_ids
    (out1,), (usage1,), _ = generate(fresh, [first], SESSION, 12)
    suffix = tokenizer(" Which towns were named, and what was traded there?").input_ids
    second = first + out1 + suffix
    (out2,), (usage2,), _ = generate(fresh, [second], SESSION, 12)
    assert usage1["evictions"] == 1 and "reused_from" not in usage1
    assert usage2["reused_from"] == "session" and usage2["evictions"] == 1

    options1 = parse_kv_options(SESSION, len(first))
    turn1 = ref.run_evicting(hf_model, torch.tensor(first), options1, BS, 12)
    assert turn1.token_ids == out1 and turn1.orders == [(len(first), True)]
    # vLLM's entry: the cache turn 1 left, its prompt and answer but the last token
    assert usage2["reused_tokens"] == turn1.length == len(first) + len(out1) - 1
    options2 = parse_kv_options(SESSION, len(second))
    turn2 = ref.run_evicting(hf_model, torch.tensor(second), options2, BS, 12, start=turn1)
    assert turn2.orders == [(len(second), True)]
    assert out2 == turn2.token_ids


def test_budgeted_requests_preempted_by_the_pool_equal_themselves_alone(
    fresh, tokenizer, monkeypatch
):
    """Nine budgeted requests whose compressed caches and outputs outgrow the 95-block pool
    while they decode: vLLM preempts some (their KV is recomputed from their tokens and
    evicted again at the prompt's end). Each preempted one must answer exactly as it does
    alone, and end with the same cache (resident tokens, prompt tokens kept)."""
    kv = {"kv_budget": 128, "kv_pipeline": "tova"}
    prompts = [tokenizer(haystack(16, seed=200 + i)).input_ids for i in range(9)]
    new = 200
    assert sum(-(-(128 + BS - 1 + new) // BS) for _ in prompts) > POOL_BLOCKS - 1
    preempted = record_preemptions(fresh, monkeypatch)
    tokens, usages, ids = generate(fresh, prompts, kv, new)
    assert preempted, "the pool must be short for this test to mean anything"
    # vLLM's internal ids are the request's own and 8 random characters
    redone = [i for i, rid in enumerate(ids) if any(p.rsplit("-", 1)[0] == rid for p in preempted)]
    assert redone and all(usages[i]["evictions"] >= 1 for i in redone)
    for i in redone:
        (alone,), (usage,), _ = generate(fresh, [prompts[i]], kv, new)
        assert alone == tokens[i], f"request {i} (preempted) differs from its run alone"
        for key in ("resident_tokens", "prompt_tokens_kept"):
            assert usage[key] == usages[i][key], (i, key, usage, usages[i])


@pytest.mark.parametrize(
    "pipeline",
    [
        pytest.param({"kv_pipeline": "tova", "kv_per_head": False}, id="tova-last"),
        pytest.param({"kv_pipeline": "h2o", "kv_scorer": "obcache_value"}, id="h2o-summed"),
    ],
)
def test_decode_evicting_requests_preempted_by_the_pool_follow_the_recompute(
    fresh, tokenizer, hf_model, monkeypatch, pipeline
):
    """With ``kv_decode`` a preempted request cannot equal its run alone: its decode-time
    evictions happened at steps the recompute does not replay. What it must equal is the HF
    reference following the recompute: the prompt evicted at its end, then the output so far
    recomputed as one segment of decode-time queries (folded into the running scores, the
    block rule's order at its end), then decoding on. Checked on the first two preempted
    requests, up to each preemption and after it. (Before the fix the recomputed output,
    several decode-time queries in one row, was scored with all of them for "last" and with
    only its first for summed scores.)"""
    from obcache_vllm.evidence import hf_reference as ref

    kv = {"kv_budget": 128, "kv_decode": True, **pipeline}
    prompts = [tokenizer(haystack(14, seed=400 + i)).input_ids for i in range(6)]
    new = 200
    # Two long stock requests grow into the pool (1,100 + 300 tokens: 35 blocks, then 44
    # each) beside six decode-evicting ones (5 or 6 blocks each once their prompts are
    # evicted): vLLM preempts the latest running ones.
    growers = [tokenizer(haystack(40, seed=410 + i)).input_ids[:1100] for i in range(2)]
    assert 2 * -(-(1100 + 300) // BS) + 6 * 5 > POOL_BLOCKS - 1
    at = record_preemptions(fresh, monkeypatch)  # internal id -> output tokens at each
    from vllm import SamplingParams

    stock = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)
    budgeted = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True, extra_args=kv)
    outs = fresh.llm.generate(
        [{"prompt_token_ids": p} for p in growers + prompts],
        [stock, stock] + [budgeted] * len(prompts), use_tqdm=False,
    )[2:]  # fmt: skip
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    ids = [o.request_id for o in outs]
    preempted = {rid.rsplit("-", 1)[0]: points for rid, points in at.items()}
    redone = [i for i, rid in enumerate(ids) if preempted.get(rid)]
    assert redone, f"the pool must be short for this test to mean anything: {at}"
    for i in redone[:2]:
        points = sorted({m for m in preempted[ids[i]] if 0 < m < new})
        prompt, done = prompts[i], 0
        options = parse_kv_options(kv, len(prompt))
        for m in [*points, new]:  # each run of the request: from its last recompute on
            ids_t = torch.tensor(prompt + tokens[i][:done])
            run = ref.run_evicting(hf_model, ids_t, options, BS, m - done,
                                   prompt_len=len(prompt))  # fmt: skip
            assert run.token_ids == tokens[i][done:m], (i, done, m)
            done = m


def test_an_error_target_session_equals_the_reference_at_the_counts_it_chose(
    fresh, hf_model, tokenizer
):
    """``kv_session`` with an error target: each turn chooses its count within what the
    earlier turns left of the target (``conversation_error``, the turns' errors added as
    norms, never above ``max_error``), and is exactly the HF reference evicting at the counts
    it chose, continuing its own cache from turn to turn. Once the target is spent, a turn
    keeps everything (its estimate 0, the conversation's unchanged)."""
    import math

    from obcache_vllm.evidence import hf_reference as ref

    target = 0.02
    kv = {"kv_budget": {"max_error": target}, "kv_session": True, "kv_pipeline": "tova"}
    prompt = tokenizer(haystack(14, seed=101)).input_ids
    runs, previous, spent = [], None, 0.0
    for turn in range(4):
        (out,), (usage,), _ = generate(fresh, [prompt], kv, 12)
        if turn:
            assert usage["reused_from"] == "session" and usage["session_turn"] == turn + 1
        mine = usage["estimated_error"]
        want = (math.sqrt(spent) + math.sqrt(mine)) ** 2 if spent and mine else spent + mine
        assert usage["conversation_error"] == pytest.approx(want, rel=1e-9, abs=1e-15)
        assert spent <= usage["conversation_error"] <= target
        spent = usage["conversation_error"]
        fixed = {**kv, "kv_budget": usage["chosen_budget"]}
        options = parse_kv_options(fixed, len(prompt))
        previous = ref.run_evicting(hf_model, torch.tensor(prompt), options, BS, 12,
                                    start=previous)  # fmt: skip
        assert previous.token_ids == out, turn
        runs.append(usage)
        prompt = prompt + out + tokenizer(f" Question {turn}: which towns were named?").input_ids
    assert runs[0]["chosen_budget"] < len(tokenizer(haystack(14, seed=101)).input_ids)
    spent_out = [u for u in runs if u["estimated_error"] == 0.0]
    assert spent_out, "the target must run out within four turns for this test to mean it"
    for u in spent_out:  # kept everything: the continued cache and the turn's new tokens
        assert u["evictions"] == 0 or u["evicted_tokens"] == 0, u
