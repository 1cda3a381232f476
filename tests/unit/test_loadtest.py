"""The load tool's planning, parsing and end-of-run checks, without a server or vLLM.

The checks are fed synthetic runs whose numbers are known, including ones that must fail (a
counter one token off, a request the server did not see): a check that passes everything is a
defect. The real server runs are in tests/server/test_observability.py and test_soak.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from loadtest import scrape
from loadtest.checks import eviction_accounting, run_checks
from loadtest.cli import is_loopback
from loadtest.client import Outcome, build_payload
from loadtest.runner import RunResult
from loadtest.scenario import Scenario, load_scenario, make_plan

REPO = Path(__file__).resolve().parents[2]
SCENARIOS = sorted((REPO / "loadtest/scenarios").glob("*.yaml"))
BASE = {
    "name": "t", "requests": 40, "duration_s": 60, "load": {"concurrency": 2},
    "prompt_tokens": {"min": 300, "max": 600}, "output_tokens": 8,
    "kinds": [{"name": "none", "weight": 0.3},
              {"name": "b", "weight": 0.7, "body": {"kv_budget": 0.1}}],
}


def _scenario(**over) -> Scenario:
    return Scenario.model_validate({**BASE, **over})


@pytest.mark.parametrize("path", [pytest.param(p, id=p.name) for p in SCENARIOS])
def test_shipped_scenarios_validate_and_plan(path: Path) -> None:
    scenario = load_scenario(path)
    plans = make_plan(scenario)
    assert len(plans) == scenario.requests
    assert {p.kind for p in plans} <= {k.name for k in scenario.kinds}
    for p in plans:  # vLLM answers 400 for n > 1 with greedy sampling
        assert p.n == 1 or p.body["temperature"] > 0 or p.expect_status != 200
    args = scenario.server.args
    if "--num-gpu-blocks-override" in args:
        blocks = int(args[args.index("--num-gpu-blocks-override") + 1])
        max_len = int(args[args.index("--max-model-len") + 1])
        # vLLM refuses to start unless the pool holds one max-model-len request (measured: 64
        # blocks of 32 allow at most 2016), and every planned request must fit the context.
        assert (blocks - 1) * 32 >= max_len
        longest = max(p.target_prompt_tokens + p.max_tokens for p in plans)
        assert longest + 64 <= max_len, (longest, max_len)  # 64: instruction + rounding


def test_plan_is_deterministic_and_follows_the_mix() -> None:
    sc = _scenario(requests=2000, stream=0.5, seed_fraction=0.25,
                   disconnect={"fraction": 0.2, "after_chunks": {"min": 2, "max": 4}})
    a, b = make_plan(sc), make_plan(sc)
    assert a == b
    share = sum(p.kind == "b" for p in a) / len(a)
    assert 0.66 < share < 0.74
    assert 0.45 < sum(p.stream for p in a) / len(a) < 0.55
    assert 0.22 < sum("seed" in p.body for p in a) / len(a) < 0.28
    dropped = [p for p in a if p.disconnect_after is not None]
    assert all(p.stream and 2 <= p.disconnect_after <= 4 for p in dropped)
    assert 0.08 < len(dropped) / len(a) < 0.12  # 20 % of the streamed half
    assert all(p.body["kv_budget"] == 0.1 for p in a if p.kind == "b")
    # ~30.5 tokens per haystack sentence: the text length follows the target.
    short = min(a, key=lambda p: p.target_prompt_tokens)
    long = max(a, key=lambda p: p.target_prompt_tokens)
    assert len(long.prompt) > 1.7 * len(short.prompt)
    assert make_plan(_scenario(seed=1))[0].prompt != make_plan(_scenario(seed=2))[0].prompt


def test_without_budgets_keeps_the_same_requests() -> None:
    sc = _scenario(kinds=[{"name": "b", "weight": 1, "body": {"kv_budget": 64, "kv_decode": True,
                                                             "top_p": 0.9}}])
    plain = sc.without_budgets()
    assert plain.kinds[0].body == {"top_p": 0.9}
    for x, y in zip(make_plan(sc), make_plan(plain), strict=True):
        assert (x.prompt, x.max_tokens, x.kind, x.stream) == (y.prompt, y.max_tokens, y.kind,
                                                              y.stream)
        assert "kv_budget" not in y.body and x.body["kv_budget"] == 64
    rejecting = _scenario(kinds=[{"name": "r", "weight": 1, "expect_status": 400}])
    with pytest.raises(ValueError, match="rejected"):
        rejecting.without_budgets()


@pytest.mark.parametrize(
    "over,match",
    [
        pytest.param({"load": {"concurrency": 2, "rate": 1.0}}, "exactly one", id="two-loads"),
        pytest.param({"kinds": [{"name": "x", "weight": 1, "body": {"stream": True}}]},
                     "set by the scenario", id="reserved-field"),
        pytest.param({"n": {2: 1.0}}, "greedy", id="n-greedy"),
        pytest.param({"prompt_tokens": {"min": 9, "max": 3}}, "min 9 > max 3", id="range"),
        pytest.param({"kinds": [{"name": "x", "weight": 1}, {"name": "x", "weight": 1}]},
                     "unique", id="duplicate-kind"),
        pytest.param({"requestz": 3}, "requestz", id="unknown-field"),
    ],
)
def test_invalid_scenarios_are_refused_with_the_reason(over: dict, match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        _scenario(**over)


def test_overrides_apply_before_validation(tmp_path: Path) -> None:
    path = REPO / "loadtest/scenarios/soak.yaml"
    sc = load_scenario(path, ["requests=7", "load.concurrency=2", "seed_fraction=0"])
    assert (sc.requests, sc.load.concurrency, sc.seed_fraction) == (7, 2, 0)
    with pytest.raises(ValueError, match="KEY=VALUE"):
        load_scenario(path, ["requests"])


def test_payload_streams_with_usage_and_merges_the_kind_body() -> None:
    plan = make_plan(_scenario(stream=1.0, requests=3))[-1]
    body = build_payload(plan, "m", "completions")
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    assert body["prompt"] == plan.prompt and body["max_tokens"] == 8 and body["n"] == 1
    chat = build_payload(plan, "m", "chat")
    assert chat["messages"] == [{"role": "user", "content": plan.prompt}]


@pytest.mark.parametrize("url,ok", [("http://127.0.0.1:8000", True), ("http://localhost:1", True),
                                    ("http://[::1]:8000", True), ("http://127.9.9.9", True),
                                    ("http://10.0.0.1:8000", False),
                                    ("http://example.com", False)])
def test_only_loopback_targets_by_default(url: str, ok: bool) -> None:
    assert is_loopback(url) is ok


METRICS_TEXT = """\
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
# TYPE vllm:obcache_evicted_tokens_total counter
vllm:obcache_evicted_tokens_total{pipeline="tova",scorer="attn"} 100.0
vllm:obcache_evicted_tokens_total{pipeline="h2o",scorer="attn"} 28.0
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 3.0
vllm:request_success_total{engine="0",finished_reason="abort",model_name="m"} 1.0
"""


def test_metrics_snapshot_sums_and_splits_by_label() -> None:
    snap = scrape.Snapshot.parse(METRICS_TEXT, 0.0)
    assert snap.value(scrape.KV_USAGE) == 0.25
    assert snap.value(scrape.EVICTED_TOKENS) == 128
    assert snap.value(scrape.EVICTED_TOKENS, pipeline="h2o") == 28
    assert snap.by_label(scrape.REQUEST_SUCCESS, "finished_reason") == {"length": 3, "abort": 1}
    assert snap.value("vllm:absent_total") == 0
    assert snap.unheld_kv_usage() == 0.25  # nothing held for compressed contexts


def test_idle_usage_leaves_out_blocks_held_for_compressed_contexts() -> None:
    info = (scrape.CACHE_CONFIG, (("block_size", "32"), ("num_gpu_blocks", "97")))
    samples = {(scrape.KV_USAGE, ()): 6 / 96, (scrape.HELD_BLOCKS, ()): 6.0, (info[0], info[1]): 1}
    assert scrape.Snapshot(0.0, samples).unheld_kv_usage() == pytest.approx(0.0)
    samples[(scrape.KV_USAGE, ())] = 10 / 96  # a request holds 4 more
    assert scrape.Snapshot(0.0, samples).unheld_kv_usage() == pytest.approx(4 / 96)


# --- end-of-run checks on synthetic runs -----------------------------------------------------


def _snap(**counters: float) -> scrape.Snapshot:
    names = {"evicted": scrape.EVICTED_TOKENS, "freed": scrape.FREED_BLOCKS,
             "finished": scrape.REQUEST_SUCCESS, "prompt": scrape.PROMPT_TOKENS,
             "gen": scrape.GENERATION_TOKENS}
    samples = {(names[k], ()): v for k, v in counters.items()}
    samples[(scrape.KV_USAGE, ())] = 0.0
    return scrape.Snapshot(0.0, samples)


def _outcome(plan, category="2xx", evicted=None, prompt=500, gen=8) -> Outcome:
    usage = {"prompt_tokens": prompt, "completion_tokens": gen}
    if evicted is not None:
        usage["obcache"] = {"evicted_tokens": evicted, "freed_blocks": evicted // 32}
    status = 200 if category in ("2xx", "disconnected") else int(category[0]) * 100
    return Outcome(plan, category=category, status=status, out=SimpleNamespace(),
                   usage=usage if category == "2xx" else None)


def _result(outcomes, before, after, max_model_len=2048) -> RunResult:
    sc = Scenario.model_validate({**BASE, "requests": len(outcomes)})
    return RunResult(
        scenario=sc, label="t", base_url="http://127.0.0.1:1", model="m",
        max_model_len=max_model_len, obcache_defaults={"kv_budget": None}, planned=len(outcomes),
        outcomes=outcomes, started_at="", duration_s=1.0, stopped_by="count", before=before,
        after=after, timeline=scrape.Timeline(), idle=True, idle_wait_s=0.0, healthy=True)


def _plans(kinds: list[str]):
    sc = Scenario.model_validate({**BASE, "requests": 200})
    pool = {k: [p for p in make_plan(sc) if p.kind == k] for k in ("none", "b")}
    return [pool[k].pop() for k in kinds]


def _by_name(result: RunResult) -> dict:
    return {c.name: c for c in run_checks(result)}


def test_exact_accounting_passes_and_one_token_off_fails() -> None:
    p = _plans(["b", "b", "none"])
    outs = [_outcome(p[0], evicted=320), _outcome(p[1], evicted=64), _outcome(p[2])]
    before = _snap(evicted=1000, freed=10, finished=5, prompt=0, gen=0)
    good = _snap(evicted=1384, freed=22, finished=8, prompt=1500, gen=24)
    checks = _by_name(_result(outs, before, good))
    assert all(c.ok for c in checks.values()), checks
    assert "usage sum 384 == counter +384" in checks["obcache_counters"].detail
    off = _snap(evicted=1385, freed=22, finished=8, prompt=1500, gen=24)
    assert _by_name(_result(outs, before, off))["obcache_counters"].ok is False
    unseen = _snap(evicted=1384, freed=22, finished=9, prompt=2000, gen=32)
    assert _by_name(_result(outs, before, unseen))["server_counts"].ok is False


def test_disconnected_budgeted_request_turns_equality_into_a_bound() -> None:
    p = _plans(["b", "b"])
    outs = [_outcome(p[0], evicted=320), _outcome(p[1], category="disconnected")]
    before = _snap(evicted=0, freed=0, finished=0, prompt=0, gen=0)
    acc = eviction_accounting(_result(outs, before, _snap(evicted=700, freed=21, finished=1,
                                                          prompt=500, gen=8), 1024))
    assert acc["unobserved_requests"] == 1 and acc["unobserved_bound"] == 1024
    ok = _by_name(_result(outs, before, _snap(evicted=700, freed=21, finished=1, prompt=900,
                                              gen=10), 1024))
    assert ok["obcache_counters"].ok and "320 <= counter +700 <= 1344" in \
        ok["obcache_counters"].detail
    low = _snap(evicted=300, freed=9, finished=1, prompt=900, gen=10)  # below what was reported
    assert _by_name(_result(outs, before, low, 1024))["obcache_counters"].ok is False
    high = _snap(evicted=1400, freed=43, finished=1, prompt=900, gen=10)  # beyond the bound
    assert _by_name(_result(outs, before, high, 1024))["obcache_counters"].ok is False


def test_usage_missing_on_a_budgeted_answer_fails() -> None:
    p = _plans(["b", "none"])
    outs = [_outcome(p[0]), _outcome(p[1], evicted=32)]  # swapped: both wrong
    before = _snap(evicted=0, freed=0, finished=0, prompt=0, gen=0)
    check = _by_name(_result(outs, before, _snap(evicted=32, freed=1, finished=2, prompt=1000,
                                                 gen=16)))["obcache_usage"]
    assert check.ok is False and f"[{p[0].index}]" in check.detail


def test_unexpected_status_and_5xx_fail() -> None:
    p = _plans(["b", "none"])
    outs = [_outcome(p[0], category="5xx"), _outcome(p[1], category="4xx")]
    before = _snap(evicted=0, freed=0, finished=0, prompt=0, gen=0)
    checks = _by_name(_result(outs, before, before))
    assert checks["no_5xx"].ok is False and checks["expected_status"].ok is False


def test_planning_and_checks_do_not_import_vllm() -> None:
    """vLLM (seconds to import, torch included) is loaded only to send and to compute metrics."""
    code = ("import sys, loadtest.cli, loadtest.checks, loadtest.compare; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'vllm', 'torch'}))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stderr


def test_a_5xx_expected_by_its_kind_is_not_an_unexpected_one() -> None:
    """An injected fault's kind expects 500: it passes both checks; a 500 elsewhere does not."""
    import dataclasses

    p = _plans(["b", "none"])
    faulty = dataclasses.replace(p[0], expect_status=500)
    before = _snap(evicted=0, freed=0, finished=0, prompt=0, gen=0)
    checks = _by_name(_result([_outcome(faulty, category="5xx"), _outcome(p[1])], before, before))
    assert checks["no_5xx"].ok and checks["expected_status"].ok
    assert "1 from injected faults" in checks["no_5xx"].detail
    other = _by_name(_result([_outcome(p[0], category="5xx"), _outcome(p[1])], before, before))
    assert other["no_5xx"].ok is False


def test_fleet_checks_read_the_router_and_the_workers() -> None:
    from loadtest import fleet

    text = ('vllm_router_processed_requests_total{worker="http://a"} 3\n'
            'vllm_router_processed_requests_total{worker="http://b"} 2\n')  # fmt: skip
    assert fleet.router_counts(text, ["http://a", "http://b"]) == [3, 2]
    assert fleet.router_counts("unavailable: refused", ["http://a"]) is None
    run = {"sent": 5, "statuses": {"200": 5}, "served_per_worker": [3.0, 2.0],
           "router_per_worker": [3.0, 2.0], "follow_ups": 2, "follow_ups_continuing": 1}
    by_name = {c["name"]: c["ok"] for c in fleet.checks(run, "consistent_hash", True)}
    assert by_name == {"healthy": True, "no_5xx": True, "counted": True, "spread": True,
                       "router_agrees": True, "affinity": False}  # one turn lost its cache
    assert "affinity" not in {c["name"] for c in fleet.checks(run, "round_robin", True)}
    lopsided = {**run, "served_per_worker": [5.0, 0.0], "router_per_worker": [4.0, 1.0]}
    by_name = {c["name"]: c["ok"] for c in fleet.checks(lopsided, "round_robin", True)}
    assert not by_name["spread"] and not by_name["router_agrees"] and by_name["counted"]


def test_parity_compares_floats_to_a_tolerance_and_everything_else_exactly():
    from loadtest.parity import same_response

    assert same_response({"logprob": -0.12345678, "text": "a"},
                         {"logprob": -0.12345679, "text": "a"})
    assert not same_response({"logprob": -0.1234}, {"logprob": -0.1244})
    assert not same_response({"text": "a"}, {"text": "b"})
    assert not same_response({"ids": [1, 2]}, {"ids": [1, 2, 3]})
    assert not same_response({"a": 1}, {"b": 1})


def _completion_events(pieces: list[list[str]], finish: str = "length") -> list[dict]:
    """Completion stream events as vLLM sends them, one per list of tokens in ``pieces``."""
    events = []
    for i, toks in enumerate(pieces):
        last = i == len(pieces) - 1
        events.append({"object": "text_completion", "model": "m", "usage": None, "choices": [{
            "index": 0, "text": "".join(toks), "finish_reason": finish if last else None,
            "logprobs": {"tokens": toks, "token_logprobs": [-0.5] * len(toks)}}]})
    events.append({"object": "text_completion", "model": "m", "choices": [],
                   "usage": {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}})
    return events


def test_parity_compares_a_stream_by_what_it_delivers_not_by_where_it_was_cut():
    from loadtest.parity import assemble_stream, same_response

    # vLLM merges the deltas of steps its HTTP side has not sent yet: a busy server sends the
    # same four tokens in fewer events.
    one_each = assemble_stream(_completion_events([[" a"], [" b"], [" c"], [" d"]]))
    merged = assemble_stream(_completion_events([[" a"], [" b", " c", " d"]]))
    assert same_response(one_each, merged)
    choice = merged["choices"][0]
    assert choice["text"] == " a b c d" and choice["finish_reason"] == "length"
    assert choice["logprobs"]["tokens"] == [" a", " b", " c", " d"]
    assert merged["usage"]["completion_tokens"] == 4
    # What a user would see differ still differs: a token, the finish reason, a log-probability.
    assert not same_response(one_each, assemble_stream(_completion_events([[" a"], [" b x"]])))
    assert not same_response(merged, assemble_stream(
        _completion_events([[" a"], [" b", " c", " d"]], finish="stop")))
    other = _completion_events([[" a"], [" b", " c", " d"]])
    other[1]["choices"][0]["logprobs"]["token_logprobs"][2] = -0.7
    assert not same_response(merged, assemble_stream(other))


def test_parity_assembles_chat_deltas_per_choice():
    from loadtest.parity import assemble_stream

    events = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"index": 1, "delta": {"role": "assistant", "content": "Yes"}}]},
        {"choices": [{"index": 0, "delta": {"content": "No"}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {"content": "."}, "finish_reason": "stop"}]},
    ]
    got = assemble_stream(events)["choices"]
    assert [c["delta"] for c in got] == [{"role": "assistant", "content": "No."},
                                         {"role": "assistant", "content": "Yes"}]
    assert got[0]["finish_reason"] == "stop"
