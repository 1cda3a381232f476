"""vLLM's own benchmark client (``vllm bench serve``) against stock vLLM and the server policy,
same install, same pool, same requests, in one run.

Each arm is a fresh ``obcache-vllm serve`` on loopback, measured by ``vllm bench serve``
(run from its module by ``benchmarks/vllm_bench_serve.py``); the clients are unchanged (no kv_*
field in any request: ``vllm bench serve`` sends none):

* ``stock``: the plugin disabled in the same install (``VLLM_PLUGINS=``), prefix caching on as
  by default;
* ``policy``: the server's default budget, ``OBCACHE_KV_BUDGET=0.25`` (what
  ``--default-kv-budget 0.25`` sets), with the policy's default compress point ``auto``: a
  prompt that shares at least half of itself with a recent prompt is compressed at the shared
  prefix, once, and later requests adopt that compressed prefix;
* ``policy-whole``: the same budget with ``OBCACHE_POLICY_COMPRESS_AT=null``: every request
  compresses its own whole prompt (the policy before ``auto``).

Workloads (``--workloads``), ``vllm bench serve`` datasets with ``--ignore-eos`` (every request
generates its full output length), ``--seed 0``:

* ``prefix-fit``: ``prefix_repetition``, 2 prefixes of 1,536 random tokens, 128-token
  suffixes, 32 generated, 32 requests, 4 at a time, 400 blocks of 32 tokens: every prefix fits
  the pool uncompressed, so stock vLLM serves every repeat from its prefix cache.
* ``prefix-pool``: the same with 6 prefixes, 48 requests, 160 blocks (5,120 tokens: three
  prompts): more prefixes than the pool holds uncompressed; stock vLLM's LRU drops and
  recomputes them.
* ``random``: unique prompts (``random``, 1,024 input and 64 output tokens), 24 requests,
  4 at a time, 100 blocks: nothing is shared.

Usage::

    .venv/bin/python benchmarks/bench_vllm_serve.py                 # all, ~15 min on 2 cores
    .venv/bin/python benchmarks/bench_vllm_serve.py --workloads prefix-pool --arms stock policy

Outputs (``--out``, default results/bench-vllm-serve): ``<workload>.<arm>.json`` (vLLM's own
result file), ``<workload>.<arm>.server.log``, ``serve.json`` (the figures below, per arm) and
``serve.md`` (requests/s, TTFT mean/p50/p99, ratios to stock, prefix-cache hit rate, entries).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from loadtest.launch import launched  # noqa: E402
from loadtest.scrape import Snapshot  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"

# name -> (dataset arguments, requests, concurrency, pool blocks); max_model_len: 4096 (2048
# for random, whose pool is below 4096 tokens: vLLM refuses to start on a pool shorter than one
# request of max_model_len)
WORKLOADS: dict[str, tuple[list[str], int, int, int]] = {
    "prefix-fit": (["--dataset-name", "prefix_repetition",
                    "--prefix-repetition-prefix-len", "1536",
                    "--prefix-repetition-suffix-len", "128",
                    "--prefix-repetition-num-prefixes", "2",
                    "--prefix-repetition-output-len", "32"], 32, 4, 400),
    "prefix-pool": (["--dataset-name", "prefix_repetition",
                     "--prefix-repetition-prefix-len", "1536",
                     "--prefix-repetition-suffix-len", "128",
                     "--prefix-repetition-num-prefixes", "6",
                     "--prefix-repetition-output-len", "32"], 48, 4, 160),
    "random": (["--dataset-name", "random", "--random-input-len", "1024",
                "--random-output-len", "64"], 24, 4, 100),
}  # fmt: skip

ARMS: dict[str, dict[str, str]] = {
    "stock": {"VLLM_PLUGINS": ""},
    "policy": {"OBCACHE_KV_BUDGET": "0.25"},
    "policy-whole": {"OBCACHE_KV_BUDGET": "0.25", "OBCACHE_POLICY_COMPRESS_AT": "null"},
}


def _scrape(url: str) -> Snapshot:
    import urllib.request

    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as resp:
        return Snapshot.parse(resp.read().decode(), time.time())


def run_arm(workload: str, arm: str, args, model_path: Path) -> dict:
    dataset, requests, concurrency, pool = WORKLOADS[workload]
    if args.quick:
        requests = max(8, requests // 4)
    max_len = "2048" if workload == "random" else "4096"
    server_args = ["--max-model-len", max_len, "--seed", "0", "--max-num-seqs", "8",
                   "--num-gpu-blocks-override", str(pool)]  # fmt: skip
    env = {**ARMS[arm], "VLLM_CPU_OMP_THREADS_BIND": "0"}  # one core: the client beside it
    log = args.out / f"{workload}.{arm}.server.log"
    name = f"{workload}.{arm}.json"
    with launched(server_args, env, log) as url:
        before = _scrape(url)
        started = time.perf_counter()
        cmd = [sys.executable, str(ROOT / "benchmarks" / "vllm_bench_serve.py"),
               "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
               "--model", MODEL, "--tokenizer", str(model_path), *dataset,
               "--num-prompts", str(requests), "--max-concurrency", str(concurrency),
               "--ignore-eos", "--seed", "0", "--percentile-metrics", "ttft,tpot,e2el",
               "--metric-percentiles", "50,99", "--save-result",
               "--result-dir", str(args.out), "--result-filename", name]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        (args.out / f"{workload}.{arm}.client.log").write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            tail = proc.stderr[-3000:]
            raise RuntimeError(f"vllm bench serve failed ({proc.returncode}):\n{tail}")
        seconds = time.perf_counter() - started
        after = _scrape(url)
    result = json.loads((args.out / name).read_text())

    def delta(metric: str, **labels) -> float:
        return after.value(metric, **labels) - before.value(metric, **labels)

    hits, queries = delta("vllm:prefix_cache_hits_total"), delta("vllm:prefix_cache_queries_total")
    return {
        "workload": workload,
        "arm": arm,
        "requests": requests,
        "completed": result["completed"],
        "failed": result.get("failed", 0),
        "seconds": round(seconds, 1),
        "request_throughput": result["request_throughput"],
        "output_throughput": result["output_throughput"],
        "mean_ttft_ms": result["mean_ttft_ms"],
        "p50_ttft_ms": result["p50_ttft_ms"],
        "p99_ttft_ms": result["p99_ttft_ms"],
        "p50_tpot_ms": result["p50_tpot_ms"],
        "prefix_hit_rate": hits / queries if queries else None,
        "entry_hits": delta("vllm:obcache_compressed_lookups_total", result="hit"),
        "entries_created": delta("vllm:obcache_compressed_entries_total", event="created"),
        "preemptions": delta("vllm:num_preemptions_total"),
    }


def markdown(rows: list[dict]) -> str:
    out = []
    for workload in dict.fromkeys(r["workload"] for r in rows):
        group = [r for r in rows if r["workload"] == workload]
        stock = next((r for r in group if r["arm"] == "stock"), None)
        out += [f"### {workload}", "",
                "| arm | req/s | vs stock | TTFT mean / p50 / p99 (ms) | TTFT p50 vs stock | "
                "prefix hit rate | entry hits / created | preemptions | failed |",
                "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in group:
            thr = r["request_throughput"]
            ratio = f"{thr / stock['request_throughput']:.2f}x" if stock else "-"
            ttft = f"{r['p50_ttft_ms'] / stock['p50_ttft_ms']:.2f}x" if stock else "-"
            if r is stock:
                ratio = ttft = "-"
            hit = "-" if r["prefix_hit_rate"] is None else f"{r['prefix_hit_rate']:.2f}"
            out.append(
                f"| {r['arm']} | {r['request_throughput']:.3f} | {ratio} | "
                f"{r['mean_ttft_ms']:.0f} / {r['p50_ttft_ms']:.0f} / {r['p99_ttft_ms']:.0f} | "
                f"{ttft} | {hit} | {r['entry_hits']:.0f} / {r['entries_created']:.0f} | "
                f"{r['preemptions']:.0f} | {r['failed']} |"
            )
        out.append("")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--quick", action="store_true", help="a quarter of the requests")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "bench-vllm-serve")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    from obcache_vllm import model

    model_path = model.pull(log=lambda m: None)
    # Rows of earlier runs into the same --out are kept unless this run measures them again.
    done = args.out / "serve.json"
    kept = json.loads(done.read_text()) if done.is_file() else []
    again = {(w, a) for w in args.workloads for a in args.arms}
    rows = [r for r in kept if (r["workload"], r["arm"]) not in again]
    for workload in args.workloads:
        for arm in args.arms:
            rows.append(run_arm(workload, arm, args, model_path))
            print(markdown(rows), flush=True)
            # written after every arm: a later arm that fails leaves the finished ones
            (args.out / "serve.json").write_text(json.dumps(rows, indent=1) + "\n")
            (args.out / "serve.md").write_text(markdown(rows) + "\n")
    print(f"wrote {args.out / 'serve.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
