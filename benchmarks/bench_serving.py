"""Memory-bound serving: stock vLLM vs obcache-vllm budgets on the same request stream.

A deliberately small KV pool and a stream of long-prompt requests. Each configuration (stock
vLLM in a child with the plugin disabled; the plugin engine with each ``kv_budget``) runs the
same requests, arriving at the same times, in its own child process. Reported per configuration,
with ratios to stock: completed requests/s and output tokens/s over the run, peak concurrently
running requests, request latency p50/p99 (arrival to last token), mean KV-pool usage; and a
plot of KV-pool usage and running requests over time.

Usage (the default model from ``obcache-vllm model pull``)::

    .venv/bin/python benchmarks/bench_serving.py                       # the measurement
    .venv/bin/python benchmarks/bench_serving.py --requests 4 --prompt-tokens 768 \\
        --max-tokens 16 --pool-blocks 64 --budgets 0.25                # a quick look (make bench)

Outputs: a Markdown table on stdout; ``--out DIR`` (default results/bench) receives
``serving.json`` and ``serving_kv_usage.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import common


def worker(args) -> dict:
    """Child: run the stream once on one engine; per-step timeline and per-request latency."""
    from vllm import SamplingParams

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # to read the scheduler each step
    llm = common.engine(args.model, args.pool_blocks, args.prompt_tokens + args.max_tokens + 64)
    tok = llm.get_tokenizer()
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    prompts = common.prompts(tok, args.requests + 1, args.prompt_tokens, seed=7)
    extra = None
    if args.budget is not None:
        extra = {"kv_budget": args.budget, "kv_pipeline": args.pipeline, "kv_scorer": args.scorer}
    params = SamplingParams(
        temperature=0, max_tokens=args.max_tokens, extra_args=extra, ignore_eos=True
    )
    llm.generate([{"prompt_token_ids": prompts[0][:256]}], params, use_tqdm=False)  # warm-up

    arrivals = [i * args.interval for i in range(args.requests)]
    start = time.perf_counter()
    pending, finished, latency, out_tokens = list(range(args.requests)), {}, {}, 0
    timeline = []  # (seconds, kv usage, running, waiting)
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while pending and arrivals[pending[0]] <= now:
            i = pending.pop(0)
            engine.add_request(f"r{i}", {"prompt_token_ids": prompts[i + 1]}, params)
        if not engine.has_unfinished_requests():
            time.sleep(min(0.05, max(0.0, arrivals[pending[0]] - now)))
            continue
        for out in engine.step():
            if out.finished:
                i = int(out.request_id.split("-")[0][1:])
                finished[i] = time.perf_counter() - start
                latency[i] = finished[i] - arrivals[i]
                out_tokens += len(out.outputs[0].token_ids)
        timeline.append(
            (
                round(time.perf_counter() - start, 3),
                round(scheduler.kv_cache_manager.usage, 4),
                len(scheduler.running),
                len(scheduler.waiting),
            )
        )
    wall = max(finished.values())
    lat = sorted(latency.values())
    return {
        "requests_per_s": args.requests / wall,
        "output_tokens_per_s": out_tokens / wall,
        "peak_running": max(t[2] for t in timeline),
        "latency_p50_s": lat[len(lat) // 2],
        "latency_p99_s": lat[min(len(lat) - 1, round(0.99 * (len(lat) - 1)))],
        "mean_kv_usage": sum(t[1] for t in timeline) / len(timeline),
        "wall_s": wall,
        "timeline": timeline,
    }


def plot(rows: list[tuple[str, dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_kv, ax_run) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for name, result in rows:
        t = [p[0] for p in result["timeline"]]
        ax_kv.plot(t, [100 * p[1] for p in result["timeline"]], label=f"budget {name}")
        ax_run.plot(t, [p[2] for p in result["timeline"]], label=f"budget {name}")
    ax_kv.set_ylabel("KV pool used (%)")
    ax_run.set_ylabel("running requests")
    ax_run.set_xlabel("seconds since the first arrival")
    ax_kv.legend(fontsize=8)
    ax_kv.set_title("Memory-bound serving: KV pool usage and concurrency over time")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = common.parser(__doc__, "serving")
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.1, 0.25, 0.5])
    ap.add_argument("--budget", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--pipeline", default="snapkv")
    ap.add_argument("--scorer", default="obcache_key")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--max-tokens", type=int, default=100)
    ap.add_argument("--pool-blocks", type=int, default=200)
    ap.add_argument("--interval", type=float, default=2.0, help="seconds between arrivals")
    ap.add_argument("--out", default="results/bench")
    args = common.parse(ap, worker)
    if args is None:
        return

    extra = [
        "--model", args.model, "--requests", str(args.requests),
        "--prompt-tokens", str(args.prompt_tokens), "--max-tokens", str(args.max_tokens),
        "--pool-blocks", str(args.pool_blocks), "--interval", str(args.interval),
        "--pipeline", args.pipeline, "--scorer", args.scorer,
    ]  # fmt: skip
    rows = [("none (stock vLLM)", common.run_child(__file__, "serving", True, extra))]
    for b in args.budgets:
        child = common.run_child(__file__, "serving", False, extra + ["--budget", str(b)])
        rows.append((f"{b:g}", child))
    base = rows[0][1]
    print(
        f"pool {args.pool_blocks} blocks x {common.BLOCK} tokens; {args.requests} requests of "
        f"{args.prompt_tokens} prompt + {args.max_tokens} output tokens, one every "
        f"{args.interval:g} s; {args.pipeline} + {args.scorer}"
    )
    print(
        "| budget | req/s | ratio | out tok/s | ratio | peak running | latency p50 s "
        "| p99 s | mean KV usage |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in rows:
        print(
            f"| {name} | {r['requests_per_s']:.3f} "
            f"| {r['requests_per_s'] / base['requests_per_s']:.2f} "
            f"| {r['output_tokens_per_s']:.1f} "
            f"| {r['output_tokens_per_s'] / base['output_tokens_per_s']:.2f} "
            f"| {r['peak_running']} | {r['latency_p50_s']:.1f} | {r['latency_p99_s']:.1f} "
            f"| {r['mean_kv_usage']:.2f} |"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k not in ("child", "stock", "budget")}
    (out / "serving.json").write_text(
        json.dumps({"settings": settings, "results": dict(rows)}, indent=1)
    )
    plot(rows, out / "serving_kv_usage.png")
    print(f"wrote {out / 'serving.json'} and {out / 'serving_kv_usage.png'}")


if __name__ == "__main__":
    main()
