"""``kv_pipeline: adakv`` through the real server: served with its outcome in ``usage.obcache``
and the eviction metrics, also with ``kv_decode`` and in sessions (vLLM's ``session_id``);
refused with a 400 naming the field for every other option that would read or rewrite its
per-head layout, and the server keeps serving."""

from __future__ import annotations

import pytest
from support.server import MODEL_NAME, Server

from obcache_vllm import metrics as M
from obcache_vllm.textgen import haystack

BLOCK = 32


def _body(**fields) -> dict:
    text = haystack(14, seed=11) + "\nSummarize the trade records above in one sentence."
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": text}],
            "max_tokens": 8, "temperature": 0, **fields}  # fmt: skip


def test_adakv_is_served_with_its_outcome_in_usage(server: Server) -> None:
    """On the shipped policy (its window and ranking apply to adakv's snapkv scores)."""
    code, reply = server.post_json("/v1/chat/completions",
                                   _body(kv_budget=64, kv_pipeline="adakv"))  # fmt: skip
    assert code == 200, reply
    kv, prompt = reply["usage"]["obcache"], reply["usage"]["prompt_tokens"]
    assert kv["pipeline"] == "adakv" and kv["evictions"] == 1
    # The same order as a uniform selection: kept per KV head on average, whole blocks freed.
    assert 64 <= kv["prompt_tokens_kept"] < 64 + BLOCK, kv
    assert kv["freed_blocks"] == kv["evicted_tokens"] // BLOCK > 0
    assert kv["evicted_tokens"] == prompt - kv["prompt_tokens_kept"]
    assert reply["choices"][0]["message"]["content"]


def test_adakv_with_kv_decode_evicts_again_while_it_decodes(server: Server) -> None:
    """With ``kv_decode`` its per-head layout is evicted again as the output fills the budget:
    more evictions, and what was evicted is the prompt's and the output's beyond the kept."""
    body = {**_body(kv_budget=64, kv_pipeline="adakv", kv_decode=True), "max_tokens": 72,
            "ignore_eos": True}  # fmt: skip
    code, reply = server.post_json("/v1/chat/completions", body)
    assert code == 200, reply
    kv, usage = reply["usage"]["obcache"], reply["usage"]
    assert kv["pipeline"] == "adakv" and kv["evictions"] >= 3, kv  # the prompt's, then decode
    assert kv["freed_blocks"] * BLOCK == kv["evicted_tokens"]
    held = usage["prompt_tokens"] + usage["completion_tokens"] - kv["evicted_tokens"]
    assert 64 <= held <= 64 + 2 * BLOCK, kv


def test_adakv_sessions_continue_over_http_with_vllms_session_id(server: Server) -> None:
    """vLLM's own ``session_id`` on adakv requests: the second turn continues the first's
    per-head cache (``reused_from: session``) and evicts again at its prompt's end."""
    first = {**_body(kv_budget=64, kv_pipeline="adakv"), "session_id": "ada-chat-1",
             "max_tokens": 16, "ignore_eos": True}  # fmt: skip
    code, reply = server.post_json("/v1/chat/completions", first)
    assert code == 200, reply
    assert reply["usage"]["obcache"]["evictions"] == 1, reply["usage"]
    answer = reply["choices"][0]["message"]["content"]
    messages = [*first["messages"], {"role": "assistant", "content": answer},
                {"role": "user", "content": "And which record came last? " * 3}]  # fmt: skip
    code, reply = server.post_json("/v1/chat/completions", {**first, "messages": messages})
    assert code == 200, reply
    kv = reply["usage"]["obcache"]
    assert kv["reused_from"] == "session" and kv["session_turn"] == 2, kv
    assert kv["pipeline"] == "adakv" and kv["evictions"] >= 1, kv


@pytest.mark.parametrize(
    ("field", "value"),
    [("kv_prefill_evict", True),
     ("kv_when", "pressure"), ("kv_budget", {"max_error": 0.05})],  # fmt: skip
)
def test_adakv_refusals_are_400_naming_the_field(server: Server, field, value) -> None:
    before = server.metrics().value(M.REJECTED_REQUESTS.exposed, field=field)
    fields = {"kv_budget": 64, "kv_pipeline": "adakv", field: value}
    code, reply = server.post_json("/v1/chat/completions", _body(**fields))
    assert code == 400, reply
    assert reply["error"]["param"] == field and "adakv" in reply["error"]["message"]
    after = server.metrics().value(M.REJECTED_REQUESTS.exposed, field=field)
    assert after == before + 1
    code, reply = server.post_json("/v1/chat/completions", _body(kv_budget=64))
    assert code == 200, reply
