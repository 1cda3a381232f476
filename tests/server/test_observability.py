"""The shipped dashboard and alerts against a real Prometheus scraping a real server, and the
load tool's short scenario against the same server.

One module fixture starts Debian's ``prometheus`` on loopback with the shipped
``deploy/prometheus/prometheus.yml`` (only the target, a 1 s scrape/evaluation interval and the
absolute path of ``alerts.yaml`` changed) scraping the session's ``obcache-vllm serve``. Then
``python -m loadtest run loadtest/scenarios/smoke.yaml`` sends budgeted, unbudgeted,
decode-evicting, non-streamed and rejected requests. Every expression of
``deploy/grafana/obcache.json`` and every alert's signal is then queried over the run through
the Prometheus HTTP API: each must parse and return at least one finite value, or be listed in
:data:`EXPECTED_EMPTY` with the reason. Without the prometheus package the Prometheus tests
skip (the load-test test still runs).
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml
from support.server import MODEL_NAME, Server, free_port, production_env

from obcache_vllm import metrics as M

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
JOB = "obcache-vllm"
RATE_INTERVAL = "10s"  # what $__rate_interval becomes (Grafana: >= 4 scrape intervals)
SUBST = {"$__rate_interval": RATE_INTERVAL, "$job": JOB, "$model_name": MODEL_NAME}
# Expressions that must come back empty from a healthy run, and why.
EXPECTED_EMPTY = {
    M.EVICTION_FAILURES.exposed: "no fault happens in a healthy run: the labelled counter has "
    "no sample until the first contained eviction failure (issue #12, failure isolation); "
    "expected empty only while the server has none (the session server also serves the "
    "fault-injection tests, tests/server/test_faults_http.py)",
    **dict.fromkeys(
        (M.COMPRESSED_LOOKUPS.exposed, M.COMPRESSED_ENTRIES.exposed, M.REUSED_TOKENS.exposed),
        "labelled by kind: no sample until the server's first request with kv_compress_at or "
        "kv_session (the smoke run has none; the fleet test's chats are kv_session)",
    ),
}


def _dashboard_exprs() -> list[tuple[str, str]]:
    dash = json.loads((DEPLOY / "grafana/obcache.json").read_text())
    return [(f"{p['title']} [{t['refId']}]", t["expr"])
            for p in dash["panels"] if p["type"] != "row" for t in p["targets"]]


_THRESHOLD = re.compile(r"^(?P<signal>.*\S)\s*(>|<|>=|<=|==|!=)\s*[0-9.eE+-]+\s*$", re.S)


def _alert_signals() -> list[tuple[str, str, str]]:
    groups = yaml.safe_load((DEPLOY / "prometheus/alerts.yaml").read_text())["groups"]
    out = []
    for rule in (r for g in groups for r in g["rules"]):
        match = _THRESHOLD.match(rule["expr"].strip())
        assert match, f"{rule['alert']}: expected 'signal > threshold', got {rule['expr']!r}"
        out.append((rule["alert"], rule["expr"], match["signal"]))
    return out


def _expected_empty(expr: str, exposed: set[str]) -> str | None:
    """Why ``expr`` may return nothing: a series the server has not exposed yet (``exposed``:
    the sample names at its /metrics)."""
    return next((why for name, why in EXPECTED_EMPTY.items()
                 if name in expr and name not in exposed), None)  # fmt: skip


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url

    def api(self, path: str, **params: str) -> dict:
        query = urllib.parse.urlencode(params, doseq=True)
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=30) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as exc:  # 400 for a query that does not parse
            return json.loads(exc.read())


@pytest.fixture(scope="module")
def prometheus(server: Server, tmp_path_factory: pytest.TempPathFactory):
    """A real Prometheus scraping ``server`` every second (None when not installed)."""
    exe = shutil.which("prometheus")
    if exe is None:
        yield None
        return
    work = tmp_path_factory.mktemp("prometheus")
    config = yaml.safe_load((DEPLOY / "prometheus/prometheus.yml").read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["rule_files"] = [str(DEPLOY / "prometheus" / f) for f in config["rule_files"]]
    (job,) = config["scrape_configs"]
    assert job["job_name"] == JOB
    job["static_configs"] = [{"targets": [server.url.removeprefix("http://")]}]
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = open(work / "prometheus.log", "w")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(
        [exe, f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=log, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert proc.poll() is None, (work / "prometheus.log").read_text()
            assert time.monotonic() < deadline, "prometheus not ready in 60 s"
            time.sleep(0.5)
        yield Prometheus(url)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


@pytest.fixture(scope="module")
def smoke(server: Server, prometheus, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """``python -m loadtest run smoke.yaml`` against the session server (Prometheus watching)."""
    out = tmp_path_factory.mktemp("smoke")
    env = production_env()
    t0 = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "loadtest", "run", "loadtest/scenarios/smoke.yaml",
         "--url", server.url, "--out", str(out), "--no-progress"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )
    t1 = time.time()
    if prometheus is not None:
        time.sleep(3)  # a few more scrapes and rule evaluations after the run
    report = json.loads((out / "report.json").read_text()) if (out / "report.json").exists() \
        else None
    return {"rc": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr[-3000:],
            "report": report, "t0": t0, "t1": t1 + 3, "out": out}


def test_loadtest_smoke_report_matches_the_server(smoke: dict) -> None:
    report = smoke["report"]
    assert report is not None, smoke["stderr"]
    assert smoke["rc"] == 0, smoke["stdout"] + smoke["stderr"]
    assert all(c["ok"] is not False for c in report["checks"]), report["checks"]
    reqs = report["requests"]
    scenario = report["scenario"]
    assert report["stopped_by"] == "count" and report["sent"] == scenario["requests"] == 12
    rejected = [r for r in reqs if r["kind"] == "rejected"]
    assert rejected and all(r["status"] == 400 for r in rejected)
    done = [r for r in reqs if r["category"] == "2xx"]
    assert len(done) == len(reqs) - len(rejected) == report["metrics"]["completed"]
    srv = report["server"]
    # The server saw exactly the client's requests and tokens.
    assert sum(srv["finished_by_reason"].values()) == len(done)
    assert srv["prompt_tokens"] == sum(r["prompt_tokens"] for r in done)
    assert srv["generation_tokens"] == sum(r["output_tokens"] for r in done)
    assert srv["obcache_rejected_requests"] == len(rejected)
    # Every budgeted answer carries usage.obcache, whose sums are the counters' increases.
    budgeted = [r for r in done if r["kind"] in ("budget_0.2", "decode_64")]
    assert budgeted and all(r["obcache"] for r in budgeted)
    assert not any(r["obcache"] for r in done if r["kind"] == "none")
    for r in budgeted:
        ob = r["obcache"]
        assert ob["evicted_tokens"] > 0 and ob["evicted_tokens"] == 32 * ob["freed_blocks"], r
    assert srv["obcache_evicted_tokens"] == sum(r["obcache"]["evicted_tokens"] for r in budgeted)
    assert srv["obcache_freed_blocks"] == sum(r["obcache"]["freed_blocks"] for r in budgeted)
    # vllm bench serve's definitions: output tokens come from usage, TTFT <= E2EL per request.
    m = report["metrics"]
    assert m["total_output_tokens"] == sum(r["output_tokens"] for r in done)
    assert m["request_throughput"] == pytest.approx(len(done) / m["duration_s"])
    streamed = [r for r in done if r["stream"]]
    assert m["streamed_completed"] == len(streamed) > 0
    assert all(0 < r["ttft_s"] <= r["latency_s"] for r in streamed)
    assert 0 < m["mean_ttft_ms"] <= m["mean_e2el_ms"] and m["p99_itl_ms"] >= m["median_itl_ms"]
    assert (smoke["out"] / "report.md").exists() and (smoke["out"] / "report.png").exists()


def _needs(prometheus) -> Prometheus:
    if prometheus is None:
        pytest.skip("prometheus not installed (Debian package prometheus; scripts/setup.sh "
                    "installs it best-effort as root)")
    return prometheus


def _range(prom: Prometheus, smoke: dict, expr: str) -> dict:
    return prom.api("query_range", query=expr, start=f"{smoke['t0'] - 2:.3f}",
                    end=f"{smoke['t1']:.3f}", step="1")


def _finite_points(result: list[dict]) -> int:
    return sum(1 for s in result for _, v in s["values"] if math.isfinite(float(v)))


def _substitute(expr: str) -> str:
    for var, value in SUBST.items():
        expr = expr.replace(var, value)
    assert "$" not in expr, expr
    return expr


def _assert_data_or_expected_empty(
    prom: Prometheus, smoke: dict, name: str, expr: str, server: Server
) -> None:
    res = _range(prom, smoke, expr)
    assert res["status"] == "success", res
    why = _expected_empty(expr, server.metrics().names())
    if why:
        assert res["data"]["result"] == [], f"expected empty ({why}): {res['data']}"
    else:
        assert _finite_points(res["data"]["result"]) > 0, f"{name}: no data for {expr}"


@pytest.mark.parametrize("name,expr", [pytest.param(n, e, id=n) for n, e in _dashboard_exprs()])
def test_dashboard_expression_returns_data(
    prometheus, smoke: dict, server: Server, name: str, expr: str
) -> None:
    _assert_data_or_expected_empty(_needs(prometheus), smoke, name, _substitute(expr), server)


@pytest.mark.parametrize("alert,expr,signal",
                         [pytest.param(*a, id=a[0]) for a in _alert_signals()])
def test_alert_signal_returns_data(prometheus, smoke: dict, server: Server, alert: str,
                                   expr: str, signal: str) -> None:
    prom = _needs(prometheus)
    assert _range(prom, smoke, expr)["status"] == "success"  # the whole rule parses
    _assert_data_or_expected_empty(prom, smoke, alert, signal, server)


def test_prometheus_loaded_the_rules_and_sees_the_server(prometheus, smoke: dict,
                                                         server: Server) -> None:
    prom = _needs(prometheus)
    groups = prom.api("rules")["data"]["groups"]
    rules = {r["name"]: r for g in groups for r in g["rules"]}
    assert set(rules) == {a for a, _, _ in _alert_signals()}
    assert all(r["health"] == "ok" for r in rules.values()), rules
    # A short run fires nothing: every rule but the failure alert waits 10 minutes ("for"), so
    # at most "pending" (the smoke run's rejected share, or a slow CI machine's TTFT, exceed
    # their thresholds for a moment); no fault was injected, so the failure alert is inactive.
    states = {name: r["state"] for name, r in rules.items()}
    assert all(s in ("inactive", "pending") for s in states.values()), states
    assert states["ObcacheEvictionFailures"] == "inactive", states
    targets = prom.api("targets")["data"]["activeTargets"]
    assert [(t["labels"]["job"], t["health"]) for t in targets] == [(JOB, "up")]
    # The template variables resolve to this server.
    jobs = prom.api("label/job/values", **{"match[]": "vllm:num_requests_running"})["data"]
    models = prom.api("label/model_name/values", **{"match[]": "vllm:num_requests_running"})
    assert jobs == [JOB] and models["data"] == [MODEL_NAME]
    # The scraped counters are the server's own values (the server is idle: nothing moves).
    local = server.metrics()
    for name in (M.EVICTED_TOKENS.exposed, M.FREED_BLOCKS.exposed, "vllm:prompt_tokens_total"):
        res = prom.api("query", query=f'sum({name}{{job="{JOB}"}})')
        assert float(res["data"]["result"][0]["value"][1]) == local.value(name), name
