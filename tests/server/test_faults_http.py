"""Contained eviction faults through the real server: one request degrades, the server serves.

The session server runs with ``OBCACHE_VLLM_FAULTS=1`` (tests/support/server.py), so a request can
ask for a fault in ``vllm_xargs`` (obcache_vllm/eviction/faults.py). A torn cache finishes that
request alone with vLLM's per-request error (HTTP 500, finish_reason "error"); a fault before
anything was written leaves it uncompressed (HTTP 200, nothing evicted). Either way
``vllm:obcache_eviction_failures_total{stage,reason}`` moves by one and the neighbours are
served. (Token identity of the neighbours is proven on exact batches in
tests/engine/test_faults.py; concurrent HTTP arrivals do not make reproducible batches.)
"""

from __future__ import annotations

import concurrent.futures as futures
import re

import pytest
from support.server import MODEL_NAME, Server

from obcache_vllm import metrics as M
from obcache_vllm.textgen import haystack

PROMPT = haystack(16, 3) + "\nWhich town is named first?"


def _completion(server: Server, **extra) -> tuple[int, dict]:
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, **extra}
    return server.post_json("/v1/completions", body)


def _failures(server: Server, stage: str, reason: str) -> float:
    return server.metrics().value(M.EVICTION_FAILURES.exposed, stage=stage, reason=reason)


@pytest.mark.parametrize(
    ("fault", "stage", "status"),
    [
        pytest.param("compact:3", "compact", 500, id="torn-cache-is-a-500-for-that-request"),
        pytest.param("score", "score", 200, id="scoring-fault-serves-it-uncompressed"),
    ],
)
def test_fault_degrades_one_request_and_neighbours_are_served(
    server: Server, fault, stage, status
) -> None:
    before = _failures(server, stage, "injected")
    with futures.ThreadPoolExecutor(4) as pool:
        faulty = pool.submit(
            _completion, server, kv_budget=64, vllm_xargs={"obcache_fault": fault}
        )
        neighbours = [pool.submit(_completion, server, kv_budget=64) for _ in range(2)]
        plain = pool.submit(_completion, server)
        code, reply = faulty.result()
        assert code == status, reply
        for n in neighbours:
            code, body = n.result()
            assert code == 200 and body["usage"]["obcache"]["evicted_tokens"] > 0, body
        assert plain.result()[0] == 200
    if status == 200:  # uncompressed: nothing evicted, every prompt token resident
        usage = reply["usage"]
        assert usage["obcache"]["fault"] == "score: injected"
        assert usage["obcache"]["evicted_tokens"] == 0
        assert usage["obcache"]["resident_tokens"] == usage["total_tokens"] - 1
    else:
        assert reply["error"]["code"] == 500
    assert _failures(server, stage, "injected") == before + 1
    assert _completion(server, kv_budget=64)[0] == 200  # still serving budgets
    # One warning line per fault, in vLLM's log format (level, time, file:line), not Python's
    # bare last-resort output: obcache_vllm logs through vLLM's handlers (install.py).
    lines = [line for line in server.log.read_text(errors="replace").splitlines()
             if f"(stage={stage} reason=injected)" in line]
    vllm_format = re.compile(r"WARNING \d\d-\d\d [\d:]+ \[\w+\.py:\d+\] obcache: eviction fault "
                             r"for request cmpl-")
    assert any(vllm_format.search(line) for line in lines), lines
    if status == 200:
        assert any(reply["id"] in line for line in lines), (reply["id"], lines)
