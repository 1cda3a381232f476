"""The multi-turn load (loadtest/multiturn.py) against the session's server: its client loop
(round-robin over active conversations, answers fed back) drives real chats, and with
``kv_session`` every follow-up turn continues the cache its conversation's last turn left."""

from __future__ import annotations

import asyncio

from support.server import Server

from loadtest import multiturn


def test_the_multi_turn_client_continues_every_follow_up_with_sessions(server: Server):
    convs = multiturn.conversations(3, seed=5, turns=(3, 3), doc=(150, 200))
    body = {"kv_budget": 0.25, "kv_session": True}
    turns = asyncio.run(multiturn.drive(server.url, "session", body, convs, clients=2, active=2))
    assert len(turns) == 9 and all(t.status == 200 for t in turns)
    # round-robin: each client alternates its conversations, turns in order within each
    for c in range(3):
        assert [t.turn for t in turns if t.conversation == c] == [1, 2, 3]
    follow = [t for t in turns if t.turn >= 2]
    assert all((t.obcache or {}).get("reused_from") == "session" for t in follow), [
        t.obcache for t in follow
    ]
    # the history grows: each turn's prompt holds the last one's and its answer
    for c in range(3):
        lengths = [t.prompt_tokens for t in turns if t.conversation == c]
        assert lengths == sorted(lengths) and len(set(lengths)) == 3
