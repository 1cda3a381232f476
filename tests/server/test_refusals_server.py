"""Refusals at the front end of the real server (issue #12, item 3; support.py).

A budget the engine cannot serve is an HTTP 400 naming the reason (``error.param`` is the
field), for streams too, before anything reaches the engine; unbudgeted requests on the same
server stay stock. And the server patches live in the API-server process only.
"""

from __future__ import annotations

from collections import Counter

import pytest
from support.server import MODEL_NAME, Server, healthy

from obcache_vllm import metrics as M


def test_server_patches_load_in_the_api_server_process_only(server: Server) -> None:
    lines = server.trace.read_text(encoding="utf-8").splitlines()
    registered = Counter(line.split()[0] for line in lines if line.endswith(" registered"))
    patched = [line.split()[0] for line in lines if line.endswith(" api-server")]
    assert len(registered) >= 3, lines  # API server, EngineCore, worker
    assert patched == [str(server.pid)], lines


@pytest.fixture(scope="module")
def plain_scheduler_server(early_server):
    """A server whose EngineCore runs the user's own scheduler (not a subclass of ours)."""
    with early_server("plain_scheduler_server") as srv:
        yield srv


def _body(endpoint: str, **fields) -> dict:
    prompt = (
        {"messages": [{"role": "user", "content": "Hello"}]}
        if "chat" in endpoint
        else {"prompt": "The capital of France is"}
    )
    return {"model": MODEL_NAME, "max_tokens": 4, "temperature": 0, **prompt, **fields}


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_budget_with_a_foreign_scheduler_class_is_400(plain_scheduler_server, endpoint, stream):
    srv = plain_scheduler_server
    before = srv.metrics().value(M.REJECTED_REQUESTS.exposed, field="kv_budget")
    code, reply = srv.post_json(endpoint, _body(endpoint, kv_budget=64, stream=stream))
    assert code == 400, reply
    assert reply["error"]["param"] == "kv_budget"
    assert "--scheduler-cls plain_scheduler.PlainScheduler" in reply["error"]["message"]
    after = srv.metrics()
    assert after.value(M.REJECTED_REQUESTS.exposed, field="kv_budget") == before + 1
    assert after.value("vllm:num_requests_running") == 0


@pytest.mark.slow
def test_unbudgeted_requests_on_that_server_are_stock(plain_scheduler_server, server):
    texts = []
    for srv in (plain_scheduler_server, server):
        code, reply = srv.post_json("/v1/completions", _body("/v1/completions", max_tokens=16))
        assert code == 200, reply
        texts.append(reply["choices"][0]["text"])
    assert texts[0] == texts[1] and texts[0]
    assert healthy(plain_scheduler_server.url)
