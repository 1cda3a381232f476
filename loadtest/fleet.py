"""A fleet on loopback: N ``obcache-vllm serve`` workers behind vllm-router, driven through it.

``python -m loadtest fleet --workers 2 --policy consistent_hash --out results/fleet`` starts
the workers (each its own engine, the test server's small settings), then ``vllm-router``
(PyPI ``vllm-router``, the vLLM project's router) in front of them, and sends multi-turn chats
through the router only: every turn resends the whole conversation with a budget and carries
its chat's ``X-Session-ID`` header, vLLM's session id, which makes each turn a session (no
``kv_session`` field: the id is enough, see docs/user_guide/sessions.md) and which the
router's ``consistent_hash``
policy hashes to pick a worker. Unbudgeted requests run beside them.

What a fleet must get right, each a named check of the report (``report.json`` / ``report.md``):

* ``healthy``: the router and every worker answer ``/health`` before and after;
* ``no_5xx``: every request through the router is a 200;
* ``counted``: the workers' ``vllm:request_success_total`` increases add up to what was sent
  (each request served exactly once, none retried twice by the router);
* ``spread``: more than one worker served requests (the fleet is used);
* ``router_agrees``: the router's own per-worker count (its Prometheus metrics) is the workers';
* ``affinity`` (``consistent_hash`` only): every turn after a chat's first continued that chat's
  compressed cache (``usage.obcache.reused_tokens`` > 0). A compressed entry lives in one
  worker's pool, so a turn routed elsewhere finds nothing: this is what the router's session
  affinity buys, and a ``round_robin`` run shows the contrast (its report counts the turns that
  found their cache, and the check is not applied).

Loopback only; the counts are small (a few chats of a few turns).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path

from loadtest.launch import LaunchError, free_port, healthy, launched, stop
from loadtest.scrape import REQUEST_SUCCESS, Snapshot
from obcache_vllm.textgen import haystack

MODEL = "SmolLM2-135M-Instruct"
# The workers: the test server's small settings (96 blocks of 16 tokens), prefix caching on.
WORKER_ARGS = (
    "--max-model-len", "2048", "--num-gpu-blocks-override", "96", "--max-num-seqs", "8",
    "--max-num-batched-tokens", "512", "--seed", "0",
)  # fmt: skip
KV = {"kv_budget": 128}  # the X-Session-ID header makes it a session (vLLM's session_id)
TURNS = ["Which towns appear in the records?", "What did they trade in the winter?",
         "Which record mentions the most crates?", "What happened in the spring?"]  # fmt: skip


def router_executable() -> str:
    """``vllm-router`` on PATH, else next to this Python (the venv's bin/)."""
    return shutil.which("vllm-router") or str(Path(sys.executable).parent / "vllm-router")


@contextmanager
def router(worker_urls: list[str], policy: str, log_path: Path, timeout_s: float = 120,
           extra_args: Sequence[str] = (), env: Mapping[str, str] | None = None):  # fmt: skip
    """Yield the base URL of a healthy ``vllm-router`` in front of ``worker_urls`` and that of
    its metrics (``extra_args``: more router flags; ``env`` over ours)."""
    exe = router_executable()
    port, metrics_port = free_port(), free_port()
    cmd = [exe, "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
           "--worker-urls", *worker_urls, "--prometheus-host", "127.0.0.1",
           "--prometheus-port", str(metrics_port), "--log-level", "warning",
           *extra_args]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True,
                                env={**os.environ, **(env or {})})  # fmt: skip
        try:
            started = time.monotonic()
            while not healthy(url):
                if proc.poll() is not None:
                    raise LaunchError(f"router exited ({proc.returncode}): "
                                      f"{log_path.read_text()[-2000:]}")  # fmt: skip
                if time.monotonic() - started > timeout_s:
                    raise LaunchError(f"router not healthy in {timeout_s:.0f} s")
                time.sleep(0.5)
            yield url, f"http://127.0.0.1:{metrics_port}"
        finally:
            stop(proc, grace_s=10)


def _post(url: str, body: dict, headers: dict, timeout: float = 300) -> tuple[int, dict]:
    req = urllib.request.Request(
        f"{url}/v1/chat/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **headers},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, {"error": err.read().decode(errors="replace")[:500]}


def _scrape(url: str) -> Snapshot:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        return Snapshot.parse(resp.read().decode(), time.time())


def chat(url: str, index: int, turns: int, max_tokens: int) -> list[dict]:
    """One session: ``turns`` turns, each resending the conversation so far."""
    messages = [{"role": "system", "content": haystack(12, seed=300 + index)}]
    out = []
    for turn in range(turns):
        messages.append({"role": "user", "content": TURNS[turn % len(TURNS)]})
        body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens,
                "temperature": 0.0, **KV}  # fmt: skip
        status, got = _post(url, body, {"X-Session-ID": f"chat-{index}"})
        usage = (got.get("usage") or {}).get("obcache") or {}
        out.append({"chat": index, "turn": turn, "status": status,
                    "reused_tokens": usage.get("reused_tokens", 0),
                    "error": got.get("error")})  # fmt: skip
        if status != 200:
            break
        messages.append({"role": "assistant", "content": got["choices"][0]["message"]["content"]})
    return out


def plain(url: str, index: int, max_tokens: int) -> dict:
    """An unbudgeted request with its own ``X-Request-ID``, as most clients send.

    Without any id header vllm-router's ``consistent_hash`` hashes the key ``request:`` for a
    chat request (its log says so; the body is not part of the key on this route): every such
    request goes to one worker, which would hide whether the fleet spreads load.
    """
    body = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0.0,
            "messages": [{"role": "user", "content": f"Name a colour. ({index})"}]}  # fmt: skip
    status, got = _post(url, body, {"X-Request-ID": f"fleet-plain-{index}-{uuid.uuid4().hex[:8]}"})
    return {"chat": None, "turn": None, "status": status, "reused_tokens": 0,
            "error": got.get("error")}  # fmt: skip


def drive(url: str, worker_urls: list[str], chats: int, turns: int, plain_requests: int,
          max_tokens: int = 8) -> dict:  # fmt: skip
    """Send everything through ``url`` (the router); the figures each check needs."""
    before = [_scrape(w) for w in worker_urls]
    with ThreadPoolExecutor(max(chats, 1) + 1) as pool:
        sessions = [pool.submit(chat, url, i, turns, max_tokens) for i in range(chats)]
        others = [pool.submit(plain, url, i, max_tokens) for i in range(plain_requests)]
        results = [r for f in sessions for r in f.result()] + [f.result() for f in others]
    after = [_scrape(w) for w in worker_urls]
    served = [a.value(REQUEST_SUCCESS) - b.value(REQUEST_SUCCESS)
              for a, b in zip(after, before, strict=True)]  # fmt: skip
    follow_ups = [r for r in results if r["turn"]]
    return {
        "sent": len(results),
        "statuses": {str(s): sum(r["status"] == s for r in results)
                     for s in sorted({r["status"] for r in results})},  # fmt: skip
        "served_per_worker": served,
        "follow_ups": len(follow_ups),
        "follow_ups_continuing": sum(r["reused_tokens"] > 0 for r in follow_ups),
        "results": results,
    }


def router_counts(text: str, worker_urls: list[str]) -> list[float] | None:
    """The router's own count of requests it sent each worker
    (``vllm_router_processed_requests_total{worker=URL}``), or None without its metrics."""
    try:
        snap = Snapshot.parse(text, time.time())
    except ValueError:
        return None
    name = "vllm_router_processed_requests_total"
    if name not in snap.names():
        return None
    return [snap.value(name, worker=url) for url in worker_urls]


def checks(run: dict, policy: str, healthy_after: bool) -> list[dict]:
    out = [
        {"name": "healthy", "ok": healthy_after},
        {"name": "no_5xx", "ok": run["statuses"] == {"200": run["sent"]},
         "detail": run["statuses"]},
        {"name": "counted", "ok": sum(run["served_per_worker"]) == run["sent"],
         "detail": f"{run['served_per_worker']} for {run['sent']} sent"},
        {"name": "spread", "ok": sum(n > 0 for n in run["served_per_worker"]) > 1,
         "detail": run["served_per_worker"]},
        {"name": "router_agrees", "ok": run["router_per_worker"] == run["served_per_worker"],
         "detail": f"router {run['router_per_worker']}, workers {run['served_per_worker']}"},
    ]  # fmt: skip
    if policy == "consistent_hash":
        out.append({"name": "affinity",
                    "ok": run["follow_ups"] > 0
                    and run["follow_ups_continuing"] == run["follow_ups"],
                    "detail": f"{run['follow_ups_continuing']} of {run['follow_ups']} follow-up "
                              "turns continued their chat's compressed cache"})  # fmt: skip
    return out


def launch_and_run(out: Path, workers: int = 2, policy: str = "consistent_hash", chats: int = 4,
                   turns: int = 3, plain_requests: int = 4, existing: tuple[str, ...] = (),
                   worker_args: tuple[str, ...] = WORKER_ARGS) -> dict:  # fmt: skip
    """Start the workers and the router, drive them, stop everything; the report.

    ``existing``: URLs of workers already running (the test suite passes its session server),
    counted among ``workers``; the others are launched with ``worker_args``.
    """
    out.mkdir(parents=True, exist_ok=True)
    env = {"VLLM_CPU_KVCACHE_SPACE": "1"}
    started = time.monotonic()
    with ExitStack() as stack:
        urls = list(existing) + [
            stack.enter_context(launched(worker_args, env, out / f"worker{i}.server.log"))
            for i in range(len(existing), workers)
        ]
        front, router_metrics = stack.enter_context(router(urls, policy, out / "router.log"))
        run = drive(front, urls, chats, turns, plain_requests)
        alive = healthy(front) and all(healthy(u) for u in urls)
        try:
            with urllib.request.urlopen(f"{router_metrics}/metrics", timeout=10) as resp:
                router_text = resp.read().decode()
        except OSError as err:
            router_text = f"unavailable: {err}"
        run["router_per_worker"] = router_counts(router_text, urls)
    report = {"workers": workers, "policy": policy, "chats": chats, "turns": turns,
              "plain_requests": plain_requests, "seconds": round(time.monotonic() - started, 1),
              **run, "checks": checks(run, policy, alive)}  # fmt: skip
    report["passed"] = all(c["ok"] for c in report["checks"])
    (out / "router.metrics.txt").write_text(router_text)
    return report


def write_report(report: dict, out: Path) -> None:
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    lines = [
        f"# Fleet: {report['workers']} workers behind vllm-router ({report['policy']})",
        "",
        f"Generated by `python -m loadtest fleet --workers {report['workers']} --policy "
        f"{report['policy']} --chats {report['chats']} --turns {report['turns']}`: "
        f"{report['chats']} chats x {report['turns']} turns (kv_budget 128, "
        f"X-Session-ID per chat) and {report['plain_requests']} unbudgeted requests, all "
        f"through the router; {report['seconds']} s including start-up.",
        "",
        f"- sent {report['sent']}, statuses {report['statuses']}",
        f"- served per worker: {report['served_per_worker']}",
        f"- follow-up turns that continued their chat's compressed cache: "
        f"{report['follow_ups_continuing']} of {report['follow_ups']}",
        "",
        "| check | ok | detail |",
        "|---|---|---|",
    ]
    for c in report["checks"]:
        lines.append(f"| {c['name']} | {c['ok']} | {c.get('detail', '')} |")
    (out / "report.md").write_text("\n".join(lines) + "\n")

