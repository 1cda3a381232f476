"""Write the generated deploy files, or check that the committed ones are current (``--check``).

    python deploy/render.py           # rewrite them
    python deploy/render.py --check   # exit 1 and name the stale files (the test suite runs this)

Generated (never edit these by hand):

* ``deploy/grafana/obcache.json``: the Grafana dashboard, from :data:`PANELS` below;
* ``deploy/k8s/base/prometheusrule.yaml``: the ``PrometheusRule`` wrapping the rule groups of
  ``deploy/prometheus/alerts.yaml`` (the file the compose Prometheus loads): one set of alerts;
* ``deploy/k8s/base/files/``: copies of ``configs/default.yaml`` and of the dashboard, because
  kustomize only reads files at or below the kustomization (``kubectl apply -k`` cannot be told
  otherwise).

Dashboard template variables: ``datasource`` (a Prometheus data source), ``job`` (the scrape
job: ``obcache-vllm`` in compose and, through the ServiceMonitor, the Service's name in
Kubernetes) and ``model_name`` (vLLM's label). The ``vllm:obcache_*`` series carry no
``model_name`` label (the plugin's stat logger does not add one), so their panels filter by
job only. Stdlib + PyYAML.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy/grafana/obcache.json"
ALERTS = ROOT / "deploy/prometheus/alerts.yaml"
RULE = ROOT / "deploy/k8s/base/prometheusrule.yaml"
COPIES = {
    ROOT / "deploy/k8s/base/files/default.yaml": ROOT / "configs/default.yaml",
    ROOT / "deploy/k8s/base/files/obcache.json": DASHBOARD,
}

VSEL = '{job=~"$job", model_name=~"$model_name"}'  # vLLM's own series
OSEL = '{job=~"$job"}'  # obcache series (no model_name label)
RATE = "[$__rate_interval]"


def _q(q: float, metric: str, sel: str, by: str = "le") -> str:
    return f"histogram_quantile({q}, sum by ({by}) (rate({metric}_bucket{sel}{RATE})))"


def _mean(metric: str, sel: str) -> str:
    return f"sum(rate({metric}_sum{sel}{RATE})) / sum(rate({metric}_count{sel}{RATE}))"


# (row, title, unit, description, [(expr, legend)])
PANELS: list[tuple[str, str, str, str, list[tuple[str, str]]]] = [
    ("vLLM", "Requests running / waiting", "short",
     "vllm:num_requests_running and vllm:num_requests_waiting.",
     [(f"sum(vllm:num_requests_running{VSEL})", "running"),
      (f"sum(vllm:num_requests_waiting{VSEL})", "waiting")]),
    ("vLLM", "KV-cache pool used", "percentunit",
     "vllm:kv_cache_usage_perc (0-1). Blocks freed by eviction go back to the pool, so "
     "budgeted requests lower it.",
     [(f"max by (model_name) (vllm:kv_cache_usage_perc{VSEL})", "{{model_name}}")]),
    ("vLLM", "Time to first token", "s", "Quantiles of vllm:time_to_first_token_seconds.",
     [(_q(0.5, "vllm:time_to_first_token_seconds", VSEL), "p50"),
      (_q(0.99, "vllm:time_to_first_token_seconds", VSEL), "p99"),
      (_mean("vllm:time_to_first_token_seconds", VSEL), "mean")]),
    ("vLLM", "Inter-token latency", "s", "Quantiles of vllm:inter_token_latency_seconds.",
     [(_q(0.5, "vllm:inter_token_latency_seconds", VSEL), "p50"),
      (_q(0.99, "vllm:inter_token_latency_seconds", VSEL), "p99")]),
    ("vLLM", "End-to-end request latency", "s",
     "Quantiles of vllm:e2e_request_latency_seconds.",
     [(_q(0.5, "vllm:e2e_request_latency_seconds", VSEL), "p50"),
      (_q(0.99, "vllm:e2e_request_latency_seconds", VSEL), "p99")]),
    ("vLLM", "Token throughput", "short",
     "Prompt and generated tokens per second (vllm:prompt_tokens, vllm:generation_tokens).",
     [(f"sum(rate(vllm:prompt_tokens_total{VSEL}{RATE}))", "prompt"),
      (f"sum(rate(vllm:generation_tokens_total{VSEL}{RATE}))", "generation")]),
    ("vLLM", "Finished requests by reason", "reqps",
     "vllm:request_success_total per finished_reason.",
     [(f"sum by (finished_reason) (rate(vllm:request_success_total{VSEL}{RATE}))",
       "{{finished_reason}}")]),
    ("vLLM", "Preemptions and prefix-cache hit rate", "short",
     "Preemptions per second (KV pool exhausted), those of requests that had evicted "
     "(vllm:obcache_compressed_preemptions_total: recomputed, then evicted again), and the "
     "prefix-cache hit ratio.",
     [(f"sum(rate(vllm:num_preemptions_total{VSEL}{RATE}))", "preemptions/s"),
      (f"sum(rate(vllm:obcache_compressed_preemptions_total{OSEL}{RATE}))",
       "of compressed requests/s"),
      (f"sum(rate(vllm:prefix_cache_hits_total{VSEL}{RATE})) / "
       f"sum(rate(vllm:prefix_cache_queries_total{VSEL}{RATE}))", "prefix-cache hit ratio")]),
    ("obcache", "Evicted tokens by scorer / pipeline", "short",
     "vllm:obcache_evicted_tokens_total per second (KV tokens per layer and KV head).",
     [(f"sum by (scorer, pipeline) (rate(vllm:obcache_evicted_tokens_total{OSEL}{RATE}))",
       "{{scorer}} / {{pipeline}}")]),
    ("obcache", "Freed KV blocks by scorer / pipeline", "short",
     "vllm:obcache_freed_blocks_total per second: blocks returned to vLLM's pool.",
     [(f"sum by (scorer, pipeline) (rate(vllm:obcache_freed_blocks_total{OSEL}{RATE}))",
       "{{scorer}} / {{pipeline}}")]),
    ("obcache", "Evictions applied", "short",
     "vllm:obcache_eviction_events_total per second (prefill + decode evictions).",
     [(f"sum by (scorer, pipeline) (rate(vllm:obcache_eviction_events_total{OSEL}{RATE}))",
       "{{scorer}} / {{pipeline}}")]),
    ("obcache", "Eviction time per engine step", "s",
     "Quantiles of vllm:obcache_eviction_seconds (worker scoring + compaction per step that "
     "evicted).",
     [(_q(0.5, "vllm:obcache_eviction_seconds", OSEL), "p50"),
      (_q(0.99, "vllm:obcache_eviction_seconds", OSEL), "p99")]),
    ("obcache", "Kept prompt ratio", "percentunit",
     "vllm:obcache_kept_prompt_ratio: prompt tokens kept by the prefill eviction / prompt "
     "tokens, per finished budgeted request.",
     [(_q(0.5, "vllm:obcache_kept_prompt_ratio", OSEL), "p50"),
      (_mean("vllm:obcache_kept_prompt_ratio", OSEL), "mean")]),
    ("obcache", "Resident KV tokens of finished budgeted requests", "short",
     "Quantiles of vllm:obcache_resident_tokens (per layer and KV head).",
     [(_q(0.5, "vllm:obcache_resident_tokens", OSEL), "p50"),
      (_q(0.99, "vllm:obcache_resident_tokens", OSEL), "p99")]),
    ("obcache", "Budgeted share of finished requests", "percentunit",
     "Finished budgeted requests (count of vllm:obcache_kept_prompt_ratio) / all finished "
     "requests (vllm:request_success_total).",
     [(f"sum(rate(vllm:obcache_kept_prompt_ratio_count{OSEL}{RATE})) / "
       f"sum(rate(vllm:request_success_total{VSEL}{RATE}))", "budgeted share")]),
    ("obcache", "Rejected requests and eviction failures", "short",
     "vllm:obcache_rejected_requests_total (HTTP 400 for a kv_* field) per field, and "
     "vllm:obcache_eviction_failures_total (faults contained to one request) per stage/reason.",
     [(f"sum by (field) (rate(vllm:obcache_rejected_requests_total{OSEL}{RATE}))",
       "rejected: {{field}}"),
      (f"sum by (stage, reason) (rate(vllm:obcache_eviction_failures_total{OSEL}{RATE}))",
       "failure: {{stage}} / {{reason}}")]),
    ("obcache: prefix cache and sessions", "Compressed-context lookups", "short",
     "vllm:obcache_compressed_lookups_total per second, by kind (compress_at, session) and "
     "result (hit: adopted, miss: recomputed). Many session misses in a fleet: check the "
     "router's session affinity.",
     [(f"sum by (kind, result) (rate(vllm:obcache_compressed_lookups_total{OSEL}{RATE}))",
       "{{kind}} {{result}}")]),
    ("obcache: prefix cache and sessions", "Reused tokens and preserved blocks", "short",
     "vllm:obcache_reused_tokens_total per second (prompt tokens not recomputed, by kind) and "
     "vllm:obcache_preserved_blocks_total per second (stock blocks copied aside before a "
     "compaction and registered).",
     [(f"sum by (kind) (rate(vllm:obcache_reused_tokens_total{OSEL}{RATE}))",
       "reused: {{kind}}"),
      (f"sum(rate(vllm:obcache_preserved_blocks_total{OSEL}{RATE}))", "preserved blocks")]),
    ("obcache: prefix cache and sessions", "Compressed entries created and evicted", "short",
     "vllm:obcache_compressed_entries_total per second by kind and event (created; evicted "
     "under the pool's LRU, the index bound or a replacement; released: no longer held out of "
     "the LRU).",
     [(f"sum by (kind, event) (rate(vllm:obcache_compressed_entries_total{OSEL}{RATE}))",
       "{{kind}} {{event}}")]),
    ("obcache: prefix cache and sessions", "Blocks held for compressed contexts", "short",
     "vllm:obcache_held_blocks: KV blocks compressed entries keep out of vLLM's LRU (at most "
     "OBCACHE_ENTRY_POOL_SHARE of the pool; counted as used in vllm:kv_cache_usage_perc, given "
     "up before a request is preempted for them).",
     [(f"sum(vllm:obcache_held_blocks{OSEL})", "held blocks")]),
    ("obcache: compression under pressure", "Compressions under pressure", "short",
     "vllm:obcache_pressure_compressions_total (kv_when=pressure requests compressed because "
     "the pool was short), vllm:obcache_preemptions_avoided_total (steps whose shortfall "
     "compression covered) and vllm:obcache_pressure_admissions_total (prompts admitted by "
     "their compressed footprint), per second, beside vLLM's preemptions.",
     [(f"sum(rate(vllm:obcache_pressure_compressions_total{OSEL}{RATE}))", "compressions"),
      (f"sum(rate(vllm:obcache_preemptions_avoided_total{OSEL}{RATE}))", "preemptions avoided"),
      (f"sum(rate(vllm:obcache_pressure_admissions_total{OSEL}{RATE}))", "admissions"),
      (f"sum(rate(vllm:num_preemptions_total{VSEL}{RATE}))", "vLLM preemptions")]),
]


def _variables() -> list[dict]:
    ds = {"type": "prometheus", "uid": "${datasource}"}
    return [
        {"name": "datasource", "label": "Data source", "type": "datasource",
         "query": "prometheus", "current": {}, "hide": 0},
        {"name": "job", "label": "Job", "type": "query", "datasource": ds,
         "query": {"query": "label_values(vllm:num_requests_running, job)",
                   "refId": "job"},
         "definition": "label_values(vllm:num_requests_running, job)",
         "includeAll": True, "multi": True, "allValue": ".*", "refresh": 2, "current": {}},
        {"name": "model_name", "label": "Model", "type": "query", "datasource": ds,
         "query": {"query": 'label_values(vllm:num_requests_running{job=~"$job"}, model_name)',
                   "refId": "model_name"},
         "definition": 'label_values(vllm:num_requests_running{job=~"$job"}, model_name)',
         "includeAll": True, "multi": True, "allValue": ".*", "refresh": 2, "current": {}},
    ]


def dashboard() -> dict:
    """The Grafana dashboard (schema of Grafana 10/11; rows, then two panels per line)."""
    ds = {"type": "prometheus", "uid": "${datasource}"}
    panels, y, next_id, row = [], 0, 1, None
    col = 0
    for row_title, title, unit, desc, targets in PANELS:
        if row_title != row:
            if col:
                y += 8
            panels.append({"type": "row", "title": row_title, "id": next_id, "collapsed": False,
                           "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
            next_id, y, col, row = next_id + 1, y + 1, 0, row_title
        panels.append({
            "type": "timeseries", "title": title, "description": desc, "id": next_id,
            "datasource": ds,
            "gridPos": {"h": 8, "w": 12, "x": 12 * col, "y": y},
            "fieldConfig": {"defaults": {"unit": unit, "custom": {"lineWidth": 1}},
                            "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom",
                                   "showLegend": True},
                        "tooltip": {"mode": "multi", "sort": "none"}},
            "targets": [{"datasource": ds, "expr": expr, "legendFormat": legend,
                         "refId": chr(ord("A") + i), "range": True, "editorMode": "code"}
                        for i, (expr, legend) in enumerate(targets)],
        })
        next_id += 1
        col = 1 - col
        if col == 0:
            y += 8
    return {
        "title": "obcache-vllm", "uid": "obcache-vllm",
        "description": "vLLM serving metrics and obcache KV-cache eviction (obcache-vllm).",
        "tags": ["vllm", "obcache", "kv-cache"], "editable": True, "graphTooltip": 1,
        "refresh": "15s", "schemaVersion": 39, "version": 1,
        "time": {"from": "now-1h", "to": "now"}, "timezone": "",
        "annotations": {"list": []}, "templating": {"list": _variables()},
        "panels": panels,
    }


def prometheus_rule(alerts_text: str) -> str:
    groups = yaml.safe_load(alerts_text)["groups"]
    rule = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "obcache-vllm"},
        "spec": {"groups": groups},
    }
    head = ("# GENERATED by deploy/render.py from deploy/prometheus/alerts.yaml: edit that file,\n"
            "# then run `python deploy/render.py`.\n")
    return head + yaml.safe_dump(rule, sort_keys=False, width=100)


def outputs() -> dict[Path, str]:
    """Every generated file and its expected content."""
    dash = json.dumps(dashboard(), indent=1) + "\n"
    out = {DASHBOARD: dash, RULE: prometheus_rule(ALERTS.read_text())}
    for dst, src in COPIES.items():
        out[dst] = dash if src == DASHBOARD else src.read_text()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="only check; exit 1 if stale")
    args = ap.parse_args(argv)
    stale = []
    for path, text in outputs().items():
        current = path.read_text() if path.exists() else None
        if current != text:
            stale.append(path.relative_to(ROOT))
            if not args.check:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
    if args.check and stale:
        print("stale (run `python deploy/render.py`): " + ", ".join(map(str, stale)))
        return 1
    print(("rewrote: " + ", ".join(map(str, stale))) if stale else "up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
