"""Concurrent seeded requests with long prompts through the real server (issue #12, item 1).

Before the fix, the first of these requests killed the engine (``CPU Generator does not use
offset``): every request got HTTP 500 and ``/health`` went 503. The test server prefills at
most 512 tokens per step (support.server.TEST_SERVER_ARGS), so ~900-token prompts are chunked,
and four of them (~113 blocks) do not fit the 96-block pool at once: they queue and run in waves.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from support.server import MODEL_NAME, Server, healthy

from obcache_vllm.textgen import haystack

CHUNK = 512
N = 4


def _round(server: Server, bodies: list[dict]) -> list[tuple[int, dict]]:
    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(lambda b: server.post_json("/v1/completions", b), bodies))


def test_concurrent_seeded_long_prompts_all_succeed_and_repeat(server: Server) -> None:
    bodies = [
        {
            "model": MODEL_NAME,
            "prompt": haystack(26, seed=900 + i) + "\nSummarize the records above.",
            "seed": i,
            "temperature": 0.7,
            "max_tokens": 8,
            "ignore_eos": True,
            # One of them compressed as well: seeds and budgets together.
            **({"kv_budget": 128} if i % 4 == 3 else {}),
        }
        for i in range(N)
    ]
    first = _round(server, bodies)
    assert [code for code, _ in first] == [200] * N, [r for c, r in first if c != 200][:1]
    assert healthy(server.url)
    # The second round reads the prefix cache (unbudgeted requests): other chunks, same texts.
    second = _round(server, bodies)
    assert [code for code, _ in second] == [200] * N
    texts = [[r["choices"][0]["text"] for _, r in rnd] for rnd in (first, second)]
    assert texts[0] == texts[1]
    for _, reply in first:
        assert reply["usage"]["prompt_tokens"] > CHUNK  # chunked prefill
        assert reply["usage"]["completion_tokens"] == 8
    assert len(set(texts[0])) == N
    kv = [r["usage"].get("obcache") for _, r in first]
    assert [k is not None for k in kv] == [i % 4 == 3 for i in range(N)]
