"""Features that compete for one pool, over HTTP, as a user meets them (the scheduler
harness's findings, tests/vllm/test_scheduler_sim.py, on the real server and model).

A server with a 47-block pool of which held compressed entries may keep 35 blocks
(``OBCACHE_ENTRY_POOL_SHARE=0.75``):

* three ``kv_session`` turns leave their compressed caches held (33 blocks); then a
  ``kv_prefill_evict`` request whose bounded peak fits the pool but not the 14 free blocks,
  and right after it a plain request. Before the fix neither ever returned (the first was
  refused before the holds could be released, every step, and vLLM stops at the head of its
  queue); now the holds give way and both finish;
* vLLM's ``session_id`` (``X-Session-ID``) never turns an error target into a session, and
  ``kv_compress_at: "auto"`` never compresses adakv or h2o at a shared prefix (neither leaves
  an entry to share).

Every request runs with the KV oracle on: no reuse of KV read anything its donor did not leave.
"""

from __future__ import annotations

import threading

import pytest
from support.server import MODEL_NAME, Server
from support.texts import haystack

from obcache_vllm import metrics as M

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def small_pool(early_server):
    with early_server("small_pool_server") as srv:
        yield srv


def _complete(srv: Server, prompt: str, max_tokens: int, timeout: float = 240, headers=None,
              **kv) -> tuple[int, dict]:  # fmt: skip
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, **kv}  # fmt: skip
    return srv.post_json("/v1/completions", body, timeout=timeout, headers=headers)


def _faults(srv: Server) -> float:
    return srv.metrics().value(M.EVICTION_FAILURES.exposed)


def test_a_prefill_evict_request_and_the_queue_behind_it_run_once_holds_give_way(small_pool):
    srv = small_pool
    faults = _faults(srv)
    for seed in (1, 2, 3):  # three sessions' first turns: ~340 tokens each left held
        code, reply = _complete(srv, haystack(12, seed=300 + seed), 8, kv_budget=330,
                                kv_session=True)  # fmt: skip
        assert code == 200, reply
    held = srv.metrics().value(M.HELD_BLOCKS.exposed)
    assert held >= 30, f"the sessions must hold most of the pool for this to mean anything: {held}"
    results: dict[str, tuple[int, dict]] = {}

    def send(name, *args, **kwargs):
        results[name] = _complete(srv, *args, **kwargs)

    # Its peak: 159 kept + 319 generated tokens = 15 blocks, of 47; 47 - held are free.
    long = threading.Thread(target=send, args=("evicting", haystack(10, seed=310), 320),
                            kwargs={"kv_budget": 128, "kv_prefill_evict": True})  # fmt: skip
    long.start()
    threading.Event().wait(1.0)
    plain = threading.Thread(target=send, args=("plain", "The capital of France is", 5))
    plain.start()
    long.join(timeout=300)
    plain.join(timeout=300)
    assert set(results) == {"evicting", "plain"}, f"stalled: {sorted(results)} returned"
    code, reply = results["evicting"]
    assert code == 200 and reply["usage"]["completion_tokens"] == 320, reply
    assert reply["usage"]["obcache"]["evictions"] >= 1
    assert results["plain"][0] == 200, results["plain"]
    assert _faults(srv) == faults  # no contained fault, no oracle mismatch


def test_a_session_id_never_makes_an_error_target_a_session(small_pool):
    srv = small_pool
    prompt = haystack(6, seed=320)
    headers = {"X-Session-ID": "target-chat"}
    usages = []
    for _ in range(2):
        code, reply = _complete(srv, prompt, 4, headers=headers,
                                kv_budget={"max_error": 0.01})  # fmt: skip
        assert code == 200, reply
        usages.append(reply["usage"]["obcache"])
        prompt += reply["choices"][0]["text"] + " And then?"
    assert all("session_turn" not in u and "reused_from" not in u for u in usages), usages
    assert all(u["max_error"] == 0.01 for u in usages)


@pytest.mark.parametrize("pipeline", ["adakv", "h2o"])
def test_auto_never_compresses_at_a_shared_prefix_for_pipelines_without_entries(
    small_pool, pipeline
):
    srv = small_pool
    document = haystack(8, seed=330)
    for question in ("Which towns appear?", "What was traded?"):
        code, reply = _complete(srv, document + question, 4, kv_budget=0.25,
                                kv_compress_at="auto", kv_pipeline=pipeline)  # fmt: skip
        assert code == 200, reply
        assert "compress_at" not in reply["usage"]["obcache"], reply["usage"]
