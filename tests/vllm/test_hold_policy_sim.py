"""The held-entry policy on vLLM's real scheduler (the model-free harness): multi-turn chats of
vLLM's multi-turn client's shape (tests/support/sched_sim/chats.py), every invariant checked
after every step. The server runs (``python -m loadtest multiturn``) measure the same policies
with the model; this pins what the policy decides."""

from __future__ import annotations

from support.sched_sim.chats import ChatLoad, simulate


def test_reuse_ranked_holds_continue_more_chats_than_least_recently_used():
    before = simulate(ChatLoad(pool_blocks=128, victims="lru", share_max=None))
    now = simulate(ChatLoad(pool_blocks=128))  # the defaults: reuse-ranked, 0.75 of the pool
    assert before.violations == 0 and now.violations == 0
    assert before.follow_ups == now.follow_ups == 105
    # round-robin clients: the least recently used entry is the next turn's
    assert now.continued >= before.continued + 8, (before.continued, now.continued)


def test_a_pool_that_holds_the_active_chats_continues_nearly_every_follow_up():
    # 4 active conversations compressed to a quarter reach ~25 blocks each by their last
    # turns: 96 blocks cannot hold them with the two running turns, 160 can
    r = simulate(ChatLoad(pool_blocks=160))
    assert r.violations == 0 and r.refused == 0
    assert r.continued >= 0.9 * r.follow_ups, (r.continued, r.follow_ups)
    assert r.counts.get("session_wanted_again", 0) <= 0.1 * r.follow_ups
