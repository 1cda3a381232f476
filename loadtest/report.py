"""Figures of one run: ``vllm bench serve``'s metric set, counts per request kind, server-side
figures from ``/metrics``, the checks; written as JSON, a Markdown table and a PNG plot.

The latency and throughput figures come from vLLM's own ``calculate_metrics``
(``vllm/benchmarks/serve.py``), so TTFT, TPOT (first token excluded), ITL, E2EL, throughput and
goodput (DistServe: a request is good when it meets every SLO given) have exactly
``vllm bench serve``'s definitions. Two calls: TTFT/TPOT/ITL/E2EL and goodput over the completed
*streamed* requests (a non-streamed answer has no observable first token), request and token
throughput over every completed request. Disconnected, cancelled and failed requests count in
neither (vLLM counts them as failed).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path
from typing import Any

from loadtest import scrape
from loadtest.checks import eviction_accounting, run_checks
from loadtest.client import CATEGORIES, Outcome
from loadtest.runner import RunResult

LATENCIES = ("ttft", "tpot", "itl", "e2el")
SERVER_COUNTERS = {
    "preemptions": scrape.PREEMPTIONS,
    "prompt_tokens": scrape.PROMPT_TOKENS,
    "generation_tokens": scrape.GENERATION_TOKENS,
    "obcache_evicted_tokens": scrape.EVICTED_TOKENS,
    "obcache_freed_blocks": scrape.FREED_BLOCKS,
    "obcache_eviction_events": scrape.EVICTION_EVENTS,
    "obcache_rejected_requests": scrape.REJECTED,
    "obcache_eviction_failures": scrape.FAILURES,
    "obcache_compressed_preemptions": scrape.COMPRESSED_PREEMPTIONS,
    "obcache_pressure_compressions": scrape.PRESSURE_COMPRESSIONS,
    "obcache_preemptions_avoided": scrape.PREEMPTIONS_AVOIDED,
    "obcache_pressure_admissions": scrape.PRESSURE_ADMISSIONS,
    "obcache_reused_tokens": scrape.REUSED_TOKENS,
}


def _pword(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def vllm_metrics(
    outcomes: list[Outcome], duration_s: float, percentiles: list[float], slo: dict[str, float]
) -> dict[str, Any]:
    """``vllm bench serve``'s result fields (same names: ``mean_ttft_ms``, ``p99_itl_ms``, ...)."""
    from vllm.benchmarks.serve import calculate_metrics

    def calc(outs):
        with contextlib.redirect_stdout(io.StringIO()):  # it prints tips and failures
            metrics, _ = calculate_metrics([], [o.out for o in outs], duration_s, None,
                                           percentiles, slo)
        return metrics

    done = [o for o in outcomes if o.completed]
    streamed = [o for o in done if o.plan.stream]
    res: dict[str, Any] = {"duration_s": duration_s, "completed": len(done),
                           "streamed_completed": len(streamed)}
    if not done:
        return res
    every = calc(done)
    res.update(
        total_input_tokens=every.total_input,
        total_output_tokens=every.total_output,
        request_throughput=every.request_throughput,
        output_throughput=every.output_throughput,
        total_token_throughput=every.total_token_throughput,
    )
    if not streamed:
        return res
    lat = calc(streamed)
    res["request_goodput"] = lat.request_goodput if slo else None
    res["max_output_tokens_per_s"] = lat.max_output_tokens_per_s
    res["max_concurrent_requests"] = lat.max_concurrent_requests
    for name in LATENCIES:
        res[f"mean_{name}_ms"] = float(getattr(lat, f"mean_{name}_ms"))
        res[f"median_{name}_ms"] = float(getattr(lat, f"median_{name}_ms"))
        res[f"std_{name}_ms"] = float(getattr(lat, f"std_{name}_ms"))
        for p, value in getattr(lat, f"percentiles_{name}_ms"):
            res[f"p{_pword(p)}_{name}_ms"] = float(value)
    return res


def _kinds(result: RunResult) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for k in result.scenario.kinds:
        outs = [o for o in result.outcomes if o.plan.kind == k.name]
        row: dict[str, Any] = {"sent": len(outs), "body": k.body}
        row.update({c: sum(1 for o in outs if o.category == c) for c in CATEGORIES})
        done = [o for o in outs if o.completed]
        row["with_usage_obcache"] = sum(1 for o in done if o.obcache is not None)
        row["mean_prompt_tokens"] = (
            sum(o.out.prompt_len for o in done) / len(done) if done else None
        )
        streamed = [o for o in done if o.plan.stream]
        if streamed:
            ttft = sorted(o.out.ttft * 1000 for o in streamed)
            row["mean_ttft_ms"] = sum(ttft) / len(ttft)
            row["mean_e2el_ms"] = sum(o.out.latency for o in streamed) * 1000 / len(streamed)
        out[k.name] = row
    return out


def summarize(result: RunResult) -> dict[str, Any]:
    """The JSON-able report of one run."""
    sc = result.scenario
    b, a = result.before, result.after
    server = {key: scrape.increase(b, a, name) for key, name in SERVER_COUNTERS.items()}
    server["finished_by_reason"] = scrape.increase_by_label(
        b, a, scrape.REQUEST_SUCCESS, "finished_reason"
    )
    server["evicted_tokens_by_scorer_pipeline"] = {
        f"{dict(k).get('scorer')}/{dict(k).get('pipeline')}": v - b.samples.get((n, k), 0.0)
        for (n, k), v in sorted(a.samples.items())
        if n == scrape.EVICTED_TOKENS and v - b.samples.get((n, k), 0.0)
    }
    server.update(result.timeline.summary())
    checks = run_checks(result)
    return {
        "label": result.label,
        "scenario": sc.model_dump(mode="json"),
        "base_url": result.base_url,
        "model": result.model,
        "max_model_len": result.max_model_len,
        "plugin": result.obcache_defaults is not None,
        "obcache_defaults": result.obcache_defaults,
        "started_at": result.started_at,
        "planned": result.planned,
        "sent": len(result.outcomes),
        "stopped_by": result.stopped_by,
        "counts": {c: sum(1 for o in result.outcomes if o.category == c) for c in CATEGORIES},
        "metrics": vllm_metrics(result.outcomes, result.duration_s, sc.percentiles,
                                sc.slo.as_vllm()),
        "kinds": _kinds(result),
        "server": server,
        "eviction_accounting": eviction_accounting(result),
        "checks": [{"name": c.name, "ok": c.ok, "detail": c.detail} for c in checks],
        "passed": all(c.ok is not False for c in checks),
        "timeline": {
            "t": result.timeline.t,
            "kv_usage": result.timeline.kv_usage,
            "running": result.timeline.running,
            "waiting": result.timeline.waiting,
            "evicted_tokens": result.timeline.evicted_tokens,
            "preemptions": result.timeline.preemptions,
        },
        "requests": [_request_row(o) for o in result.outcomes],
    }


def _request_row(o: Outcome) -> dict[str, Any]:
    return {
        "i": o.plan.index, "kind": o.plan.kind, "category": o.category, "status": o.status,
        "stream": o.plan.stream, "n": o.plan.n, "chunks": o.chunks,
        "prompt_tokens": o.out.prompt_len, "output_tokens": o.out.output_tokens,
        "ttft_s": round(o.out.ttft, 4), "latency_s": round(o.out.latency, 4),
        "obcache": o.obcache, "error": o.error[:200] or None,
    }


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return f"{value:.{digits}f}" if abs(value) < 1e6 else f"{value:.3g}"
    return str(value)


def markdown(s: dict[str, Any]) -> str:
    """One run as Markdown: metric table, counts per kind, server figures, checks."""
    m, sc = s["metrics"], s["scenario"]
    lines = [
        f"### {s['label']}: scenario `{sc['name']}`",
        "",
        f"{s['sent']}/{s['planned']} requests sent to {s['base_url']} (model `{s['model']}`, "
        f"plugin: {'yes' if s['plugin'] else 'no'}), {m['duration_s']:.1f} s, stopped by "
        f"{s['stopped_by']}; load {json.dumps(sc['load'])}; SLO {json.dumps(sc['slo'])}.",
        "",
        "| metric | value |",
        "|---|---:|",
    ]
    for key in ("completed", "request_throughput", "request_goodput", "output_throughput",
                "total_token_throughput"):
        lines.append(f"| {key} | {_fmt(m.get(key), 3)} |")
    pct = [f"p{_pword(p)}" for p in sc["percentiles"] if p != 50]  # p50 is the median
    lines += ["", "| latency ms | mean | median | " + " | ".join(pct) + " |",
              "|---|" + "---:|" * (2 + len(pct))]
    for name in LATENCIES:
        cells = [m.get(f"{k}_{name}_ms") for k in ("mean", "median", *pct)]
        lines.append(f"| {name.upper()} | " + " | ".join(_fmt(c) for c in cells) + " |")
    lines += ["", "| kind | sent | " + " | ".join(CATEGORIES)
              + " | usage.obcache | mean prompt tok | mean TTFT ms | mean E2EL ms |",
              "|---|" + "---:|" * (len(CATEGORIES) + 5)]
    for name, row in s["kinds"].items():
        lines.append(
            f"| {name} | {row['sent']} | " + " | ".join(str(row[c]) for c in CATEGORIES)
            + f" | {row['with_usage_obcache']} | {_fmt(row['mean_prompt_tokens'], 0)} | "
            f"{_fmt(row.get('mean_ttft_ms'), 0)} | {_fmt(row.get('mean_e2el_ms'), 0)} |"
        )
    srv = s["server"]
    lines += ["", "| server (/metrics) | value |", "|---|---:|"]
    for key in ("kv_usage_mean", "kv_usage_max", "running_mean", "running_max", "waiting_max"):
        lines.append(f"| {key} | {_fmt(srv[key], 3)} |")
    for key in SERVER_COUNTERS:
        lines.append(f"| {key} (increase) | {_fmt(srv[key], 0)} |")
    lines.append(f"| finished_by_reason | {json.dumps(srv['finished_by_reason'])} |")
    lines += ["", "| check | result | detail |", "|---|---|---|"]
    for c in s["checks"]:
        verdict = {True: "pass", False: "**FAIL**", None: "n/a"}[c["ok"]]
        lines.append(f"| {c['name']} | {verdict} | {c['detail'].replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def plot(summaries: list[dict[str, Any]], path: Path) -> None:
    """KV-pool usage, running and waiting requests over time; one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = (("kv_usage", "KV pool used (kv_cache_usage_perc)"),
              ("running", "requests running"), ("waiting", "requests waiting"),
              ("evicted_tokens", "evicted tokens (cumulative)"),
              ("preemptions", "preemptions (cumulative)"))
    fig, axes = plt.subplots(len(series), 1, figsize=(9, 10), sharex=True)
    for s in summaries:
        tl = s["timeline"]
        for ax, (key, _) in zip(axes, series, strict=True):
            ax.plot(tl["t"], tl[key], label=s["label"])
    for ax, (_, title) in zip(axes, series, strict=True):
        ax.set_ylabel(title, fontsize=8)
        ax.grid(alpha=0.3)
    axes[0].set_ylim(0, 1.05)
    axes[0].legend(loc="upper right", fontsize=8)
    axes[-1].set_xlabel("seconds since the first request")
    fig.suptitle(f"scenario {summaries[0]['scenario']['name']}: server state during the run")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(summary: dict[str, Any], out_dir: Path, stem: str = "report") -> list[Path]:
    """``stem.json``, ``stem.md``, ``stem.png`` in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{stem}.json", out_dir / f"{stem}.md", out_dir / f"{stem}.png"]
    paths[0].write_text(json.dumps(summary, indent=1, default=str) + "\n")
    paths[1].write_text(markdown(summary))
    plot([summary], paths[2])
    return paths
