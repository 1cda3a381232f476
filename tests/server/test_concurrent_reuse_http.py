"""Compressed contexts reused by requests in flight together, over HTTP (the session server).

Questions over one document (kv_compress_at) and follow-up turns of one chat (kv_session) are
sent at once, with the arrival skew of concurrent clients; each must get the same text as the
same request sent alone under a cache salt of its own. The server runs with the KV oracle on
(tests/support/server.py), so every adoption and copy is also checked against what its donor
left, and a mismatch would show in ``vllm:obcache_eviction_failures_total{stage="verify"}``.
"""

from __future__ import annotations

import threading
import time

from support.server import MODEL_NAME, Server

from obcache_vllm import metrics as M
from obcache_vllm.eviction.ledger import USAGE_FIELDS
from obcache_vllm.textgen import haystack

STAGGER_S = (0.0, 0.05, 0.15, 0.3, 0.6, 1.0, 2.0)


def _post_all(server: Server, path: str, bodies: list[dict]) -> list[dict]:
    """POST every body from its own thread, the i-th after STAGGER_S[i] seconds."""
    results: list[dict | None] = [None] * len(bodies)

    def send(i: int) -> None:
        time.sleep(STAGGER_S[i])
        status, body = server.post_json(path, bodies[i])
        assert status == 200, body
        results[i] = body

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    assert all(r is not None for r in results)
    return results  # type: ignore[return-value]


def _verify_faults(server: Server) -> float:
    return server.metrics().value(M.EVICTION_FAILURES.exposed, stage="verify")


def _tokenize(server: Server, text: str) -> list[int]:
    status, body = server.post_json("/tokenize", {"model": MODEL_NAME, "prompt": text,
                                                  "add_special_tokens": False})  # fmt: skip
    assert status == 200, body
    return body["tokens"]


def test_questions_over_one_document_sent_at_once_match_each_alone(server: Server):
    doc = _tokenize(server, haystack(40, seed=57))[:1009]  # not a multiple of the block size
    questions = [_tokenize(server, f" Question {i}: which town traded crates in season {i}? "
                                   "Answer:") for i in range(len(STAGGER_S))]  # fmt: skip
    kv = {"kv_budget": 0.25, "kv_pipeline": "tova", "kv_compress_at": len(doc)}
    faults = _verify_faults(server)

    def body(q, salt=None):
        b = {"model": MODEL_NAME, "prompt": doc + q, "max_tokens": 16, "temperature": 0, **kv}
        return {**b, "cache_salt": salt} if salt else b

    together = _post_all(server, "/v1/completions", [body(q) for q in questions])
    assert all(set(r["usage"]["obcache"]) <= set(USAGE_FIELDS) for r in together)
    reused = [r["usage"]["obcache"].get("reused_tokens") for r in together]
    assert sum(1 for n in reused if n == len(doc)) >= 2, reused  # followers adopted the entry
    for i, (q, got) in enumerate(zip(questions, together, strict=True)):
        status, alone = server.post_json("/v1/completions", body(q, salt=f"alone-doc-{i}"))
        assert status == 200 and "reused_tokens" not in alone["usage"]["obcache"]
        assert got["choices"][0]["text"] == alone["choices"][0]["text"], (i, reused[i])
    assert _verify_faults(server) == faults


def test_follow_up_turns_of_one_chat_sent_at_once_match_each_alone(server: Server):
    kv = {"kv_budget": 160, "kv_session": True, "kv_pipeline": "tova"}
    system = {"role": "system", "content": "Records:\n" + haystack(18, seed=59)}
    first = [system, {"role": "user", "content": "Which towns appear?"}]
    follow_ups = ["What was traded?", "Which year comes first?", "Name one more town.",
                  "And the season?"]  # fmt: skip
    faults = _verify_faults(server)

    def chat(messages, salt=None):
        b = {"model": MODEL_NAME, "messages": messages, "max_tokens": 16, "temperature": 0, **kv}
        return {**b, "cache_salt": salt} if salt else b

    def branches(answer):
        turn = [*first, {"role": "assistant", "content": answer}]
        return [[*turn, {"role": "user", "content": q}] for q in follow_ups]

    status, opened = server.post_json("/v1/chat/completions", chat(first))
    assert status == 200
    answer = opened["choices"][0]["message"]["content"]
    together = _post_all(server, "/v1/chat/completions", [chat(m) for m in branches(answer)])
    assert all(set(r["usage"]["obcache"]) <= set(USAGE_FIELDS) for r in together)
    turns = [r["usage"]["obcache"].get("session_turn") for r in together]
    assert turns.count(2) >= 2, turns  # the follow-ups continued the first turn's cache
    for i, got in enumerate(together):
        salt = f"alone-chat-{i}"
        status, again = server.post_json("/v1/chat/completions", chat(first, salt))
        assert status == 200 and again["choices"][0]["message"]["content"] == answer
        status, alone = server.post_json("/v1/chat/completions", chat(branches(answer)[i], salt))
        assert status == 200 and alone["usage"]["obcache"].get("session_turn") == 2
        assert got["choices"][0]["message"]["content"] == alone["choices"][0]["message"]["content"]
    assert _verify_faults(server) == faults


def test_auto_compresses_a_shared_document_once_and_followers_match_each_alone(server: Server):
    """``kv_compress_at: "auto"`` (the server policy's default point): the first question over a
    document compresses its whole prompt but its last token, the second the document's shared
    blocks (a new entry), the rest, sent at once, adopt that entry; each gets the text of the
    same request computed alone at the same point under a cache salt of its own."""
    doc = _tokenize(server, haystack(40, seed=61))[:1009]
    questions = [_tokenize(server, f" Question {i}: what was traded in season {i}? Answer:")
                 for i in range(2 + len(STAGGER_S))]  # fmt: skip
    kv = {"kv_budget": 0.25, "kv_pipeline": "tova"}
    faults = _verify_faults(server)

    def body(q, point="auto", salt=None):
        b = {"model": MODEL_NAME, "prompt": doc + q, "max_tokens": 16, "temperature": 0,
             "kv_compress_at": point, **kv}  # fmt: skip
        return {**b, "cache_salt": salt} if salt else b

    status, first = server.post_json("/v1/completions", body(questions[0]))
    assert status == 200, first  # a first sighting: all but its last token
    assert first["usage"]["obcache"]["compress_at"] == len(doc + questions[0]) - 1
    status, second = server.post_json("/v1/completions", body(questions[1]))
    assert status == 200, second
    shared = second["usage"]["obcache"]["compress_at"]
    assert shared == len(doc) // 32 * 32  # the document's whole blocks (block size 32)
    assert "reused_tokens" not in second["usage"]["obcache"]
    together = _post_all(server, "/v1/completions", [body(q) for q in questions[2:]])
    usage = [r["usage"]["obcache"] for r in together]
    assert all(u["compress_at"] == shared and u.get("reused_tokens") == shared for u in usage)
    for i, (q, got) in enumerate(zip(questions[1:], [second, *together], strict=True)):
        status, alone = server.post_json("/v1/completions", body(q, shared, f"alone-auto-{i}"))
        assert status == 200 and "reused_tokens" not in alone["usage"]["obcache"]
        assert got["choices"][0]["text"] == alone["choices"][0]["text"], i
    assert _verify_faults(server) == faults


def test_auto_serves_a_chats_next_turns_as_a_session_and_each_matches_alone(server: Server):
    """``kv_compress_at: "auto"`` on a chat (the server policy's default): the first turn is
    compressed whole as a tentative session (it may be a chat's first turn: its cache is
    left), the second continues a prompt the server saw (served as ``kv_session``) and so
    continues that cache, as do the third and fourth; each matches the same conversation
    replayed under a cache salt of its own (its own turns: the same continuations)."""
    kv = {"kv_budget": 160, "kv_pipeline": "tova", "kv_compress_at": "auto"}
    system = {"role": "system", "content": "Records:\n" + haystack(18, seed=63)}
    asks = ["Which towns appear?", "What was traded?", "Which year comes first?", "And then?"]
    faults = _verify_faults(server)

    def converse(salt=None):
        messages, usages, texts = [system], [], []
        for ask in asks:
            messages = [*messages, {"role": "user", "content": ask}]
            body = {"model": MODEL_NAME, "messages": messages, "max_tokens": 16,
                    "temperature": 0, **kv}  # fmt: skip
            status, reply = server.post_json("/v1/chat/completions",
                                             {**body, "cache_salt": salt} if salt else body)
            assert status == 200, reply
            text = reply["choices"][0]["message"]["content"]
            messages = [*messages, {"role": "assistant", "content": text}]
            usages.append({**reply["usage"]["obcache"],
                           "prompt_tokens": reply["usage"]["prompt_tokens"]})  # fmt: skip
            texts.append(text)
        return usages, texts

    usages, texts = converse()
    assert [u.get("session_turn") for u in usages] == [None, 2, 3, 4], usages
    # the first turn all but its last token (a repeat of it would adopt that), a session's
    # turns each prompt whole
    assert usages[0]["compress_at"] == usages[0]["prompt_tokens"] - 1
    assert all("compress_at" not in u for u in usages[1:])
    again, replayed = converse("alone-auto-chat")
    assert [u.get("session_turn") for u in again] == [None, 2, 3, 4]
    assert texts == replayed
    assert _verify_faults(server) == faults


def test_re_sent_contexts_are_served_from_their_first_compression_with_its_answer(
    server: Server,
):
    """A context sent again (a retry, an agent re-sending it): under ``kv_compress_at:
    "auto"`` its first sighting compressed all but its last token and left that compressed
    prompt on its (tentative) session entry's blocks; each re-send, several in flight at once
    and newest first, compresses at the same point, adopts it (reusing all but one token) and
    answers exactly as the first did."""
    kv = {"kv_budget": 0.25, "kv_pipeline": "tova", "kv_compress_at": "auto"}
    faults = _verify_faults(server)

    def body(i: int) -> dict:
        system = {"role": "system", "content": f"Archive {i}:\n" + haystack(30, seed=300 + i)}
        ask = {"role": "user", "content": f"Which town appears first in archive {i}?"}
        return {"model": MODEL_NAME, "messages": [system, ask], "max_tokens": 12,
                "temperature": 0, **kv}  # fmt: skip

    firsts = []
    for i in range(3):
        status, reply = server.post_json("/v1/chat/completions", body(i))
        assert status == 200, reply
        firsts.append(reply)
    again = _post_all(server, "/v1/chat/completions", [body(i) for i in (2, 1, 0)])[::-1]
    for first, reply in zip(firsts, again, strict=True):
        u0, u = first["usage"]["obcache"], reply["usage"]["obcache"]
        assert "reused_from" not in u0
        assert u0["compress_at"] == first["usage"]["prompt_tokens"] - 1
        assert u.get("reused_from") == "compress_at", u
        assert u["reused_tokens"] == u["compress_at"] == u0["compress_at"]
        text = reply["choices"][0]["message"]["content"]
        assert text == first["choices"][0]["message"]["content"]
    assert _verify_faults(server) == faults


def test_vllm_session_id_makes_a_budgeted_chat_a_session(server: Server):
    """vLLM's own ``session_id`` (the ``X-Session-ID`` header, the body field or
    ``vllm_xargs``) on a budgeted request without ``kv_session``: its next turn continues the
    cache it left, as with ``kv_session``; h2o, whose sums cannot travel with a cache, keeps its
    own options (the id stays vLLM's: routing, KV events); without an id nothing continues."""
    kv = {"kv_budget": 160, "kv_pipeline": "tova"}
    system = {"role": "system", "content": "Records:\n" + haystack(18, seed=67)}
    faults = _verify_faults(server)

    def two_turns(tag: str, extra: dict, headers: dict | None = None, pipeline="tova"):
        messages, turns = [system, {"role": "user", "content": f"Which towns appear? ({tag})"}], []
        for ask in ("What was traded?", None):
            body = {"model": MODEL_NAME, "messages": messages, "max_tokens": 12,
                    "temperature": 0, **kv, "kv_pipeline": pipeline, **extra}  # fmt: skip
            status, reply = server.post_json("/v1/chat/completions", body, headers=headers)
            assert status == 200, reply
            turns.append(reply["usage"]["obcache"].get("session_turn"))
            if ask:
                answer = {"role": "assistant", "content": reply["choices"][0]["message"]["content"]}
                messages = [*messages, answer, {"role": "user", "content": ask}]
        return turns

    assert two_turns("header", {}, {"X-Session-ID": "chat-header"}) == [None, 2]
    assert two_turns("body", {"session_id": "chat-body"}) == [None, 2]
    assert two_turns("xargs", {"vllm_xargs": {"session_id": "chat-xargs"}}) == [None, 2]
    assert two_turns("none", {}) == [None, None]
    assert two_turns("h2o", {"session_id": "chat-h2o"}, pipeline="h2o") == [None, None]
    assert _verify_faults(server) == faults
