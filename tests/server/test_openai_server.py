"""The OpenAI-compatible server with per-request KV budgets, through the official `openai` client.

One real `obcache-vllm serve` process on 127.0.0.1 for the whole session (`server`, see
tests/conftest.py and tests/support/server.py), plus one stock-vLLM server (`VLLM_PLUGINS=`) for the
identity test. Every timeout is generous: the development machine runs this on one loaded core.
"""

from __future__ import annotations

import math
import time

import pytest
from support.server import MODEL_NAME, POOL_BLOCKS, Server

from loadtest.scrape import Snapshot as Metrics
from obcache_vllm import metrics as M
from obcache_vllm.textgen import haystack

BLOCK = 32
CLIENT_TIMEOUT_S = 300


def _client(server: Server):
    from openai import OpenAI

    return OpenAI(
        base_url=server.base_url, api_key="unused", timeout=CLIENT_TIMEOUT_S, max_retries=0
    )


def _chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _long_text(num_sentences: int, seed: int) -> str:
    return haystack(num_sentences, seed) + "\nSummarize the trade records above in one sentence."


def _eventually(check, timeout_s: float = 30.0, every_s: float = 0.25):
    """``check()`` until it returns a truthy value (returned) or the time is up (last value)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(every_s)


def _obcache_usage(usage) -> dict:
    from obcache_vllm.eviction.ledger import USAGE_FIELDS

    extra = usage.model_extra or {}
    assert "obcache" in extra, usage
    assert set(extra["obcache"]) <= set(USAGE_FIELDS), extra["obcache"]  # the documented keys
    return extra["obcache"]


def _counters(m: Metrics, scorer: str, pipeline: str) -> tuple[float, float, float]:
    labels = {"scorer": scorer, "pipeline": pipeline}
    return (
        m.value(M.EVICTED_TOKENS.exposed, **labels),
        m.value(M.FREED_BLOCKS.exposed, **labels),
        m.value(M.EVICTION_EVENTS.exposed, **labels),
    )


def _idle(server: Server) -> Metrics | None:
    """/metrics once nothing runs and no request holds a block (None if that does not happen;
    blocks held for compressed contexts are no request's: Snapshot.unheld_kv_usage)."""

    def check():
        m = server.metrics()
        running = m.value("vllm:num_requests_running") + m.value("vllm:num_requests_waiting")
        return m if running == 0 and m.unheld_kv_usage() == 0 else None

    return _eventually(check, timeout_s=60)


# --- GET /v1/obcache/config ----------------------------------------------------------------


def test_config_endpoint_lists_scorers_pipelines_and_defaults(server: Server) -> None:
    from obcache_vllm.config import load_defaults
    from obcache_vllm.scoring import PIPELINE_NAMES, SCORER_NAMES

    doc = server.get_json("/v1/obcache/config")
    assert doc["scorers"] == list(SCORER_NAMES)
    assert doc["pipelines"] == list(PIPELINE_NAMES)
    # The test server runs with configs/default.yaml (its content: tests/unit/test_server_config).
    assert doc["defaults"] == load_defaults({})
    assert doc["defaults"]["kv_pipeline"] == "snapkv" and doc["defaults"]["kv_per_head"] is True
    assert doc["usage_field"] == "usage.obcache"


# --- A budgeted request: usage.obcache and the metrics -------------------------------------


def test_budgeted_chat_reports_kv_outcome_and_metrics_move_by_exactly_that(server: Server) -> None:
    budget, scorer, pipeline = 64, "obcache_value", "h2o"  # labels no other test uses
    before = _idle(server)
    assert before is not None, "server not idle"
    reply = _client(server).chat.completions.create(
        model=MODEL_NAME,
        messages=_chat(_long_text(14, seed=1)),
        temperature=0,
        max_tokens=8,
        extra_body={"kv_budget": budget, "kv_scorer": scorer, "kv_pipeline": pipeline},
    )
    assert reply.choices[0].message.content
    usage = reply.usage
    kv = _obcache_usage(usage)
    assert (kv["budget"], kv["scorer"], kv["pipeline"]) == (budget, scorer, pipeline)
    # Budget rule: whole blocks are freed, so budget <= kept < budget + block size.
    assert budget <= kv["prompt_tokens_kept"] < budget + BLOCK, kv
    assert kv["evicted_tokens"] == usage.prompt_tokens - kv["prompt_tokens_kept"]
    assert kv["freed_blocks"] == kv["evicted_tokens"] // BLOCK and kv["evictions"] == 1
    # Resident at the end: the kept prompt plus every generated token but the last (its KV is
    # never computed).
    assert kv["resident_tokens"] == kv["prompt_tokens_kept"] + usage.completion_tokens - 1

    def moved():
        after = server.metrics()
        delta = [
            a - b
            for a, b in zip(
                _counters(after, scorer, pipeline), _counters(before, scorer, pipeline), strict=True
            )
        ]
        finished = after.value(f"{M.RESIDENT_TOKENS.name}_count") - before.value(
            f"{M.RESIDENT_TOKENS.name}_count"
        )
        return (after, delta) if finished >= 1 else None

    result = _eventually(moved)
    assert result is not None, "the finished request never reached /metrics"
    after, delta = result
    assert delta == [kv["evicted_tokens"], kv["freed_blocks"], kv["evictions"]]
    count = f"{M.RESIDENT_TOKENS.name}_count"
    total = f"{M.RESIDENT_TOKENS.name}_sum"
    assert after.value(count) - before.value(count) == 1
    assert after.value(total) - before.value(total) == kv["resident_tokens"]
    ratio_sum = f"{M.KEPT_RATIO.name}_sum"
    assert math.isclose(
        after.value(ratio_sum) - before.value(ratio_sum),
        kv["prompt_tokens_kept"] / usage.prompt_tokens,
        rel_tol=1e-6,
    )
    seconds = f"{M.EVICTION_SECONDS.name}_count"
    assert after.value(seconds) - before.value(seconds) >= 1
    # Every stock metric is still there.
    for name in (
        "vllm:kv_cache_usage_perc",
        "vllm:num_requests_running",
        "vllm:prompt_tokens_total",
    ):
        assert name in after.names(), name


def test_completions_fields_in_vllm_xargs_and_top_level_override(server: Server) -> None:
    reply = _client(server).completions.create(
        model=MODEL_NAME,
        prompt=_long_text(8, seed=2),
        temperature=0,
        max_tokens=4,
        extra_body={
            "vllm_xargs": {"kv_budget": 48, "kv_scorer": "random", "kv_pipeline": "snapkv"},
            "kv_scorer": "key_norm",  # a top-level field overrides vllm_xargs
        },
    )
    kv = _obcache_usage(reply.usage)
    assert (kv["budget"], kv["scorer"], kv["pipeline"]) == (48, "key_norm", "snapkv")
    assert 48 <= kv["prompt_tokens_kept"] < 48 + BLOCK


def test_a_query_agnostic_request_gets_the_shipped_selection(server: Server) -> None:
    """default.yaml's ``query_agnostic`` (the rule's query-agnostic winner): a request with a
    ``kv_compress_at`` position and no selection field is served with it (the engine reports
    its pipeline and scorer, and its tokens and kept count are those of the request that names
    the selection); naming one selection field gives the ordinary defaults for the rest."""
    from obcache_vllm.config import load_policy

    agnostic = load_policy({}).query_agnostic
    assert agnostic and agnostic["kv_pipeline"] != "snapkv", agnostic  # what the rule shipped
    assert server.get_json("/v1/obcache/config")["policy"]["query_agnostic"] == agnostic

    def complete(fields: dict) -> tuple[list[int], dict]:
        reply = _client(server).completions.create(
            model=MODEL_NAME, prompt=_long_text(24, seed=31), temperature=0, max_tokens=12,
            logprobs=1, extra_body=fields,
        )  # fmt: skip
        return reply.choices[0].logprobs.tokens, _obcache_usage(reply.usage)

    base = {"kv_budget": 0.3, "kv_compress_at": -24}
    tokens, kv = complete(base)
    assert (kv["pipeline"], kv["scorer"]) == (agnostic["kv_pipeline"], agnostic["kv_scorer"])
    assert kv["evictions"] == 1 and "reused_tokens" not in kv, kv  # compressed here
    # The same options adopt that compressed context (an entry is keyed by the options too),
    # or compress the same: either way its tokens and kept count.
    named_tokens, named = complete({**base, **agnostic})
    assert tokens == named_tokens
    assert kv["prompt_tokens_kept"] == named["prompt_tokens_kept"]
    _, partial = complete({**base, "kv_scorer": "attn"})
    assert (partial["pipeline"], partial["scorer"]) == ("snapkv", "attn")
    _, whole = complete({"kv_budget": 0.3})
    assert whole["pipeline"] == "snapkv" and "compress_at" not in whole


def test_query_agnostic_and_named_selections_in_flight_together_keep_their_own_contexts(
        server: Server) -> None:  # fmt: skip
    """The same document and compress point sent at once with the policy's query-agnostic
    selection and with the defaults' (one field named): each compresses its own context (a
    compressed context is keyed by its options, so neither adopts the other's), and a later
    request of each adopts its own and gives the tokens it gave in flight.

    The session's server carries the entries earlier tests held (up to 3/4 of its 95 blocks),
    and a compressed context is only copied into an entry while the pool has room for it beside
    what the running requests need next: so the pair starts after one unbudgeted request of
    nearly the whole context (63 blocks), which held entries give way to, leaving at most 32
    held, and the pair is small (two 10-block prompts, two 3-block entries)."""
    from concurrent.futures import ThreadPoolExecutor

    flush = _client(server).completions.create(
        model=MODEL_NAME, prompt=haystack(66, seed=42), temperature=0, max_tokens=1)
    block = 32  # `obcache-vllm serve`'s --block-size
    needs = math.ceil((flush.usage.prompt_tokens + 1) / block)
    assert needs >= 63, flush.usage
    held = server.metrics().value(M.HELD_BLOCKS.exposed)
    assert held <= POOL_BLOCKS - 1 - needs, held
    prompt = _long_text(10, seed=41)
    base = {"kv_budget": 0.3, "kv_compress_at": -24}
    arms = [base, {**base, "kv_scorer": "obcache_key"}]  # tova (the policy's), snapkv

    def complete(fields: dict) -> tuple[list[str], dict]:
        reply = _client(server).completions.create(
            model=MODEL_NAME, prompt=prompt, temperature=0, max_tokens=12, logprobs=1,
            extra_body=fields)  # fmt: skip
        return reply.choices[0].logprobs.tokens, _obcache_usage(reply.usage)

    with ThreadPoolExecutor(len(arms)) as pool:
        together = list(pool.map(complete, arms))
    assert [kv["pipeline"] for _, kv in together] == ["tova", "snapkv"]
    for _, kv in together:
        assert kv["evictions"] == 1 and "reused_tokens" not in kv, kv
    for fields, (tokens, kv) in zip(arms, together, strict=True):
        again, usage = complete(fields)
        assert usage["reused_from"] == "compress_at" and usage["pipeline"] == kv["pipeline"]
        assert again == tokens, fields


def test_an_error_target_chooses_its_budget_and_reports_it(server: Server) -> None:
    """``kv_budget: {"max_error": e}`` (an object at the top level, its scalar form in
    ``vllm_xargs``): the server keeps the fewest whole blocks whose estimate is within e and
    says what it chose in ``usage.obcache``; a looser target keeps fewer tokens."""
    client = _client(server)
    prompt = _long_text(14, seed=4)
    chosen = {}
    for e, body in ((0.002, {"kv_budget": {"max_error": 0.002}}),
                    (0.05, {"vllm_xargs": {"kv_budget": "max_error:0.05"}})):  # fmt: skip
        reply = client.completions.create(
            model=MODEL_NAME, prompt=prompt, temperature=0, max_tokens=4,
            extra_body={**body, "kv_pipeline": "tova"},
        )  # fmt: skip
        kv = _obcache_usage(reply.usage)
        n = reply.usage.prompt_tokens
        assert kv["max_error"] == e and 0 <= kv["estimated_error"] <= e
        assert kv["prompt_tokens_kept"] == kv["chosen_budget"] == kv["budget"]
        assert kv["budget_floor"] <= kv["budget"]
        assert (n - kv["chosen_budget"]) % BLOCK == 0
        assert kv["freed_blocks"] * BLOCK == n - kv["chosen_budget"]
        chosen[e] = kv["chosen_budget"]
    assert chosen[0.05] < chosen[0.002], chosen


def test_a_kl_target_chooses_its_budget_in_nats_and_reports_it(server: Server) -> None:
    """``kv_budget: {"max_kl": nats}`` naming no selection field: served with the server's
    shipped selection (snapkv, window 32, per head, ``dropkv``), which the default model ships
    a calibration of (one of two: ``obcache_vllm/calibrations/``); the choice and its
    predicted KL are reported in ``usage.obcache``; a looser target keeps no more tokens."""
    client = _client(server)
    prompt = _long_text(30, seed=5)
    chosen = {}
    for nats, body in ((0.05, {"kv_budget": {"max_kl": 0.05}}),
                       (0.8, {"vllm_xargs": {"kv_budget": "max_kl:0.8"}})):  # fmt: skip
        reply = client.completions.create(model=MODEL_NAME, prompt=prompt, temperature=0,
                                          max_tokens=4, extra_body=body)  # fmt: skip
        kv = _obcache_usage(reply.usage)
        n = reply.usage.prompt_tokens
        assert kv["max_kl"] == nats and "max_error" not in kv, kv
        assert (kv["pipeline"], kv["scorer"]) == ("snapkv", "dropkv"), kv
        assert kv["budget_floor"] <= kv.get("budget", n)
        if "chosen_budget" in kv:
            assert 0 <= kv["estimated_kl"] <= nats
            assert kv["freed_blocks"] * BLOCK == n - kv["chosen_budget"]
        chosen[nats] = kv.get("chosen_budget", n)
    assert chosen[0.8] <= chosen[0.05] and chosen[0.8] < n, chosen  # 0.8 nats frees blocks


def test_request_without_budget_reports_nothing_and_ratio_budget_applies(server: Server) -> None:
    client = _client(server)
    plain = client.completions.create(
        model=MODEL_NAME, prompt="The capital of France is", temperature=0, max_tokens=4
    )
    assert "obcache" not in (plain.usage.model_extra or {})
    ratio = client.completions.create(
        model=MODEL_NAME,
        prompt=_long_text(8, seed=3),
        temperature=0,
        max_tokens=2,
        extra_body={"kv_budget": 0.5},
    )
    kv = _obcache_usage(ratio.usage)
    assert kv["budget"] == math.ceil(0.5 * ratio.usage.prompt_tokens)


# --- Bad inputs: HTTP 400 naming the field, nothing allocated, server keeps serving -------

BAD_INPUTS = [
    pytest.param({"kv_budget": 64, "kv_scorer": "magic"}, "kv_scorer", id="unknown-scorer"),
    pytest.param({"kv_budget": 64, "kv_pipeline": "magic"}, "kv_pipeline", id="unknown-pipeline"),
    pytest.param({"kv_budget": 0}, "kv_budget", id="budget-zero"),
    pytest.param({"kv_budget": -8}, "kv_budget", id="budget-negative"),
    pytest.param({"kv_budget": float("nan")}, "kv_budget", id="budget-nan"),
    pytest.param({"kv_budget": "64"}, "kv_budget", id="budget-string"),
    pytest.param({"kv_budget": 1.5}, "kv_budget", id="ratio-above-one"),
    pytest.param({"kv_budget": [64]}, "kv_budget", id="budget-list"),
    pytest.param({"kv_budget": 64, "kv_window": 0}, "kv_window", id="window-zero"),
    pytest.param({"kv_budget": 64, "kv_window": "8"}, "kv_window", id="window-string"),
    pytest.param({"kv_budget": 20, "kv_sinks": 4, "kv_recent": 16}, "kv_budget", id="sinks+recent"),
    pytest.param({"kv_budget": 64, "kv_decode": "maybe"}, "kv_decode", id="decode-type"),
    pytest.param({"kv_budget": 64, "kv_sinks": {"a": 1}}, "kv_sinks", id="sinks-object"),
    pytest.param({"kv_budget": 64, "kv_foo": 1}, "kv_foo", id="unknown-field"),
    pytest.param({"kv_scorer": "obcache_key"}, "kv_scorer", id="option-without-budget"),
    pytest.param({"kv_budget": 99999}, "kv_budget", id="beyond-context"),
    pytest.param({"kv_budget": 64, "kv_window": 4096}, "kv_window", id="window-beyond-context"),
    pytest.param({"vllm_xargs": {"kv_budget": -1}}, "kv_budget", id="in-vllm_xargs"),
    pytest.param({"kv_budget": {"max_error": 0}}, "kv_budget", id="target-zero"),
    pytest.param({"kv_budget": {"max_error": 0.1, "max": 5}}, "kv_budget", id="target-key"),
    pytest.param({"kv_budget": {"max_error": 0.1}, "kv_pipeline": "streaming"}, "kv_budget",
                 id="target-without-queries"),
    pytest.param({"vllm_xargs": {"kv_budget": "max_error:-1"}}, "kv_budget",
                 id="target-in-vllm_xargs"),
    pytest.param({"kv_budget": {"max_kl": 0.2, "max_error": 0.1}}, "kv_budget", id="kl-and-error"),
    pytest.param({"kv_budget": {"max_kl": 0.2}, "kv_decode": True}, "kv_budget",
                 id="kl-target-with-decode"),
    # the engine's refusal: the model's calibration was measured with window 32
    pytest.param({"kv_budget": {"max_kl": 0.2}, "kv_window": 64}, "kv_window",
                 id="kl-target-uncalibrated-window"),
]


def _send_bad(server: Server, endpoint: str, fields: dict) -> tuple[int, str]:
    """(HTTP status, error message) of a request carrying ``fields``.

    Through the `openai` client (``extra_body``), except for a NaN, which that client refuses to
    encode: it goes as raw JSON (``NaN``, which Python's and the server's JSON parsers accept).
    """
    import openai

    if any(isinstance(v, float) and math.isnan(v) for v in fields.values()):
        path, body = (
            ("/v1/chat/completions", {"messages": _chat("Hello")})
            if endpoint == "chat"
            else ("/v1/completions", {"prompt": "Hello"})
        )
        code, reply = server.post_json(
            path, {"model": MODEL_NAME, "max_tokens": 2, **body, **fields}
        )
        return code, reply["error"]["message"]
    client = _client(server)
    try:
        if endpoint == "chat":
            client.chat.completions.create(
                model=MODEL_NAME, messages=_chat("Hello"), max_tokens=2, extra_body=fields
            )
        else:
            client.completions.create(
                model=MODEL_NAME, prompt="Hello", max_tokens=2, extra_body=fields
            )
    except openai.BadRequestError as exc:
        return exc.status_code, exc.message
    return 200, ""


@pytest.mark.parametrize("fields, field", BAD_INPUTS)
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_bad_kv_option_is_400_naming_the_field(server: Server, fields, field, endpoint) -> None:
    before = server.metrics().value(M.REJECTED_REQUESTS.exposed, field=field)
    code, message = _send_bad(server, endpoint, fields)
    assert code == 400, (code, message)
    assert field in message, message
    after = server.metrics()
    assert after.value(M.REJECTED_REQUESTS.exposed, field=field) == before + 1
    assert after.value("vllm:num_requests_running") == 0
    assert after.unheld_kv_usage() == 0


def test_bad_option_on_a_stream_is_400_before_streaming(server: Server) -> None:
    code, body = server.post_json(
        "/v1/chat/completions",
        {
            "model": MODEL_NAME,
            "messages": _chat("Hello"),
            "max_tokens": 2,
            "stream": True,
            "kv_budget": 64,
            "kv_pipeline": "nope",
        },
    )
    assert code == 400 and "kv_pipeline" in body["error"]["message"], body
    assert body["error"]["param"] == "kv_pipeline"


# Checks that need the tokenized prompt: made in the serving handler before it returns, so a
# stream is refused with a 400 too (not an error event after a 200).
PROMPT_DEPENDENT = [
    pytest.param({"kv_budget": 0.001}, "kv_budget", id="fraction-rounds-below-sinks+recent"),
    pytest.param({"kv_budget": 99999}, "kv_budget", id="beyond-context"),
    pytest.param({"kv_budget": 64, "kv_compress_at": 100000}, "kv_compress_at",
                 id="compress-at-past-prompt"),
    pytest.param({"kv_budget": 64, "kv_window": 2049}, "kv_window", id="window-beyond-context"),
]


@pytest.mark.parametrize("fields, field", PROMPT_DEPENDENT)
@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/completions"])
def test_prompt_dependent_bad_option_on_a_stream_is_400(server: Server, fields, field, endpoint):
    before = server.metrics().value(M.REJECTED_REQUESTS.exposed, field=field)
    body = {"messages": _chat("Hello")} if "chat" in endpoint else {"prompt": "Hello"}
    code, reply = server.post_json(
        endpoint, {"model": MODEL_NAME, "max_tokens": 2, "stream": True, **body, **fields}
    )
    assert code == 400 and field in reply["error"]["message"], reply
    assert reply["error"]["param"] == field
    after = server.metrics()
    assert after.value(M.REJECTED_REQUESTS.exposed, field=field) == before + 1  # counted once
    assert after.value("vllm:num_requests_running") == 0


def test_normal_request_succeeds_after_rejections(server: Server) -> None:
    reply = _client(server).chat.completions.create(
        model=MODEL_NAME,
        messages=_chat("What is the capital of France?"),
        temperature=0,
        max_tokens=16,
        extra_body={"kv_budget": 64},
    )
    assert "Paris" in reply.choices[0].message.content


# --- Streaming, disconnects, pool usage ----------------------------------------------------


def test_streaming_with_budget_reports_usage_in_final_chunk(server: Server) -> None:
    stream = _client(server).chat.completions.create(
        model=MODEL_NAME,
        messages=_chat(_long_text(8, seed=4)),
        temperature=0,
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"kv_budget": 96, "kv_pipeline": "tova"},
    )
    text, usage = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage is not None:
            usage = chunk.usage
    assert text and usage is not None
    kv = _obcache_usage(usage)
    assert kv["pipeline"] == "tova" and 96 <= kv["prompt_tokens_kept"] < 96 + BLOCK
    assert kv["resident_tokens"] == kv["prompt_tokens_kept"] + usage.completion_tokens - 1


def _usage_while_generating(server: Server, extra_body: dict) -> float:
    """kv_cache_usage_perc seen mid-generation of a long prompt; then the client disconnects.

    Checks that the disconnect leaves no request and no block behind.
    """
    stream = _client(server).chat.completions.create(
        model=MODEL_NAME,
        messages=_chat(_long_text(24, seed=5)),
        temperature=0,
        max_tokens=400,
        stream=True,
        extra_body={"ignore_eos": True, **extra_body},
    )
    seen = 0
    usage = None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            seen += 1
        if seen >= 3:
            usage = server.metrics().unheld_kv_usage()  # this request's blocks
            break
    stream.close()  # the client goes away mid-stream
    assert usage is not None
    assert _idle(server) is not None, "blocks or requests left behind after the disconnect"
    return usage


def test_compressed_request_uses_less_of_the_pool_and_disconnect_frees_everything(
    server: Server,
) -> None:
    assert _idle(server) is not None
    compressed = _usage_while_generating(server, {"kv_budget": 64})
    full = _usage_while_generating(server, {})
    print(f"\nkv_cache_usage_perc mid-generation: kv_budget=64 {compressed:.4f}, none {full:.4f}")
    # ~700 prompt tokens: ~23 of the 96 blocks without a budget, 3-4 with it.
    assert full > 0.15, full
    assert compressed < full / 3, (compressed, full)
    assert compressed <= 6 / POOL_BLOCKS, compressed


# --- Stock identity ------------------------------------------------------------------------


def test_no_budget_gives_stock_vllm_text_through_the_server(
    server: Server, stock_server: Server
) -> None:
    prompt = _long_text(6, seed=6)
    outs = []
    for srv in (server, stock_server):
        client = _client(srv)
        chat = client.chat.completions.create(
            model=MODEL_NAME, messages=_chat(prompt), temperature=0, max_tokens=32
        )
        comp = client.completions.create(
            model=MODEL_NAME, prompt=prompt, temperature=0, max_tokens=32
        )
        outs.append((chat.choices[0].message.content, comp.choices[0].text))
    assert outs[0] == outs[1]
    # And the stock server really is stock: none of our metrics, no config endpoint.
    assert not [n for n in stock_server.metrics().names() if n.startswith("vllm:obcache_")]
    code, _ = stock_server.post_json("/v1/obcache/config", {})
    assert code in (404, 405)
