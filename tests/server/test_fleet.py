"""A fleet through vllm-router (loadtest/fleet.py): the session's server and a second worker
with the same settings behind the vLLM project's router (PyPI ``vllm-router``), multi-turn
chats with a budget and vLLM's ``X-Session-ID`` header (no ``kv_session`` field: the id makes
each turn a session), routed by ``consistent_hash`` on that header.

The report's checks must all pass: every request a 200, each served exactly once (the workers'
success counters add up to what was sent), both workers used, and every follow-up turn
continued its chat's compressed cache, which lives in one worker's pool: the router's session
affinity is what makes sessions work in a fleet. ``python -m loadtest fleet`` is the
same run with every worker launched (results/fleet/).
"""

from __future__ import annotations

import pytest
from support.server import TEST_SERVER_ARGS

from loadtest import fleet

pytestmark = [pytest.mark.server, pytest.mark.slow]


def test_sessions_through_the_router_stick_to_their_worker(server, tmp_path) -> None:
    # The router hashes each chat's session id (and each plain request's X-Request-ID) onto a
    # ring of the workers' URLs, whose ports are random. A CI run sent all 20 requests to one
    # worker: headerless plain requests shared one key then, leaving 9 independent keys (1 in
    # 256). 8 chats and 8 plain requests with their own ids are 16 keys: 1 in 32,768.
    report = fleet.launch_and_run(tmp_path, workers=2, chats=8, turns=2, plain_requests=8,
                                  existing=(server.url,), worker_args=TEST_SERVER_ARGS)
    failed = [c for c in report["checks"] if not c["ok"]]
    # The router's own routing decisions, not its shutdown traceback, explain a failure.
    routed = [line.rsplit("CONSISTENT_HASH_DEBUG: ", 1)[-1]
              for line in (tmp_path / "router.log").read_text().splitlines()
              if "mapped to worker" in line]  # fmt: skip
    assert not failed, (failed, routed)
    assert {c["name"] for c in report["checks"]} == {
        "healthy", "no_5xx", "counted", "spread", "router_agrees", "affinity"}
    assert report["follow_ups"] == 8 and report["follow_ups_continuing"] == 8
