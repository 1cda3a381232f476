"""``kv_session`` on the real engine: a chat continues its compressed cache, bounded over turns,
shared safely, cleaned up with the prefix cache, and invisible to unbudgeted requests."""

from __future__ import annotations

import pytest
from support.engine import POOL_BLOCKS
from support.texts import haystack

BS = 32
BUDGET = 160
SESSION = {"kv_budget": BUDGET, "kv_session": True, "kv_pipeline": "tova"}
TURNS = ["Which towns appear?", "What was traded?", "Which year comes first?",
         "Name one more town.", "Thanks. Any other fact?", "And the season?"]  # fmt: skip


@pytest.fixture
def fresh(engine):
    assert engine.llm.reset_prefix_cache()
    yield engine
    assert engine.free_blocks() == POOL_BLOCKS - 1


def _chat(engine, messages, kv, max_tokens=16):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, extra_args=dict(kv))
    out = engine.llm.chat(messages, params, use_tqdm=False)[0]
    usage = (out.kv_transfer_params or {}).get("obcache")
    return out.outputs[0].text, list(out.outputs[0].token_ids), usage


def _conversation(engine, kv, turns, seed=3):
    messages = [{"role": "system", "content": "Records:\n" + haystack(18, seed=seed)}]
    usages, answers = [], []
    for question in turns:
        messages.append({"role": "user", "content": question})
        text, tokens, usage = _chat(engine, messages, kv)
        messages.append({"role": "assistant", "content": text})
        usages.append(usage)
        answers.append(tokens)
    return usages, answers, messages


@pytest.mark.parametrize(
    "kv",
    [
        pytest.param({}, id="tova"),
        pytest.param({"kv_pipeline": "snapkv", "kv_window": 8, "kv_decode": True}, id="snapkv"),
        pytest.param({"kv_pipeline": "streaming", "kv_decode": True}, id="streaming"),
    ],
)
def test_turns_continue_the_previous_cache_and_stay_bounded(fresh, kv):
    engine = fresh
    usages, _, _ = _conversation(engine, {**SESSION, **kv}, TURNS)
    assert "reused_tokens" not in usages[0]
    for turn, usage in enumerate(usages[1:], start=2):
        # Continued from the whole previous turn (its prompt and output as cached) ...
        assert usage["reused_from"] == "session" and usage["session_turn"] == turn
        assert usage["reused_tokens"] > usages[turn - 2]["resident_tokens"]
        # ... and the cache it leaves is its budget plus this turn's growth, whatever the turn.
        growth = usage["reused_tokens"] - usages[turn - 2]["reused_tokens"] if turn > 2 else 0
        assert usage["resident_tokens"] < BUDGET + BS + max(growth, 64), usage
    assert max(u["resident_tokens"] for u in usages) < BUDGET + 2 * BS + 64


def test_two_follow_ups_of_one_entry_at_once_are_each_as_alone(fresh):
    """Both adopt the same cached blocks: each copies what its compaction writes (CoW)."""
    from vllm import SamplingParams

    engine = fresh
    _, _, messages = _conversation(engine, SESSION, TURNS[:1])
    branches = [messages + [{"role": "user", "content": q}] for q in TURNS[1:3]]
    params = SamplingParams(temperature=0, max_tokens=16, extra_args=dict(SESSION))
    together = engine.llm.chat(branches, params, use_tqdm=False)
    assert all(o.kv_transfer_params["obcache"]["reused_from"] == "session" for o in together)
    for branch, out in zip(branches, together, strict=True):
        _, alone, usage = _chat(engine, branch, SESSION)
        assert usage["reused_from"] == "session"
        assert list(out.outputs[0].token_ids) == alone


def test_reset_and_a_changed_history_never_continue_a_wrong_cache(fresh):
    engine = fresh
    _, _, messages = _conversation(engine, SESSION, TURNS[:2])
    # The client rewrites an earlier answer: no entry's tokens are a prefix any more (the first
    # turn's prompt still is, but its entry holds its output too).
    edited = [dict(m) for m in messages] + [{"role": "user", "content": TURNS[2]}]
    edited[2]["content"] = "Something else entirely."
    _, _, usage = _chat(engine, edited, SESSION)
    assert "reused_tokens" not in usage
    assert engine.llm.reset_prefix_cache()
    assert len(engine.scheduler.obcache_prefix.entries) == 0
    _, _, usage = _chat(engine, messages + [{"role": "user", "content": TURNS[2]}], SESSION)
    assert "reused_tokens" not in usage  # gone with the prefix cache


def test_unbudgeted_requests_after_sessions_are_stock(fresh):
    engine = fresh
    _, _, messages = _conversation(engine, SESSION, TURNS[:3])
    engine.llm.reset_prefix_cache()
    cold, _, _ = _chat(engine, messages, {}, max_tokens=12)
    _conversation(engine, SESSION, TURNS[:3])  # the same history, as sessions, again
    warm, _, _ = _chat(engine, messages, {}, max_tokens=12)
    assert warm == cold
