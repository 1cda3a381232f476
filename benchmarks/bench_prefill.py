"""Prefill eviction benchmarks: stock vLLM vs obcache-vllm in the same run, ratios reported.

Two measurements, each run in fresh subprocesses (one per configuration) so that stock vLLM
(``VLLM_PLUGINS=``, plugin disabled) and the plugin engine see identical settings:

* ``overhead``: time of a prefill (+1 token) of P-token prompts, unbudgeted on stock vLLM vs
  budgeted (25 %) on obcache-vllm, for each scorer. The ratio is the cost of scoring + compaction.
* ``serving``: a deliberately small KV pool and many long prompts; requests/s, output tokens/s
  and peak concurrently running requests, without eviction (stock) and with budgets.

Usage (the default model from ``obcache-vllm model pull``)::

    .venv/bin/python benchmarks/bench_prefill.py overhead --lengths 2048 4096
    .venv/bin/python benchmarks/bench_prefill.py serving --budgets 0.1 0.25 0.5
"""

from __future__ import annotations

import argparse
import os
import time

from common import BLOCK, SCORERS, default_model, emit, run_child
from common import engine as _engine
from common import prompts as _prompts


def worker_overhead(args) -> dict:
    from vllm import SamplingParams

    llm = _engine(args.model, None, max(args.lengths) + 64)
    tok = llm.get_tokenizer()
    configs = [None] if args.stock else list(SCORERS)
    results = {}
    for length in args.lengths:
        prompts = _prompts(tok, args.repeats + 1, length, seed=length)
        for scorer in configs:
            extra = None if scorer is None else {
                "kv_budget": 0.25, "kv_scorer": scorer, "kv_pipeline": "snapkv", "kv_window": 32
            }
            params = SamplingParams(temperature=0, max_tokens=1, extra_args=extra)
            times = []
            for i, p in enumerate(prompts):
                t = time.perf_counter()
                llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)
                if i:  # the first one warms up
                    times.append(time.perf_counter() - t)
            results[f"{length}:{scorer or 'stock'}"] = sorted(times)[len(times) // 2]
    return results


def worker_serving(args) -> dict:
    from vllm import SamplingParams

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # to read the scheduler each step
    llm = _engine(args.model, args.pool_blocks, args.prompt_tokens + args.max_tokens + 64)
    tok = llm.get_tokenizer()
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    prompts = _prompts(tok, args.requests + 1, args.prompt_tokens, seed=7)
    extra = None if args.budget is None else {"kv_budget": args.budget, "kv_pipeline": "snapkv"}
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, extra_args=extra,
                            ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)  # warm-up
    for i, p in enumerate(prompts[1:]):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    peak, out_tokens, start = 0, 0, time.perf_counter()
    usage = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                out_tokens += len(out.outputs[0].token_ids)
        peak = max(peak, len(scheduler.running))
        usage.append(scheduler.kv_cache_manager.usage)
    wall = time.perf_counter() - start
    return {
        "requests_per_s": args.requests / wall,
        "output_tokens_per_s": out_tokens / wall,
        "peak_running": peak,
        "mean_kv_usage": sum(usage) / len(usage),
        "wall_s": wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("mode", choices=["overhead", "serving"])
    ap.add_argument("--model", default=None, help="model dir (default: the provisioned model)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.1, 0.25, 0.5])
    ap.add_argument("--budget", type=float, default=None)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--pool-blocks", type=int, default=400)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--stock", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.model = default_model(args.model)
    if args.child:
        fn = worker_overhead if args.mode == "overhead" else worker_serving
        emit(fn(args))  # vLLM also logs to stdout
        return

    common = ["--model", args.model]
    if args.mode == "overhead":
        extra = common + ["--lengths", *map(str, args.lengths), "--repeats", str(args.repeats)]
        stock = run_child(__file__, "overhead", True, extra)
        ours = run_child(__file__, "overhead", False, extra)
        print("| prompt tokens | scorer | stock s | obcache s | ratio |")
        print("|---|---|---|---|---|")
        for length in args.lengths:
            base = stock[f"{length}:stock"]
            for scorer in SCORERS:
                t = ours[f"{length}:{scorer}"]
                print(f"| {length} | {scorer} | {base:.3f} | {t:.3f} | {t / base:.3f} |")
        return

    extra = common + [
        "--requests", str(args.requests), "--prompt-tokens", str(args.prompt_tokens),
        "--max-tokens", str(args.max_tokens), "--pool-blocks", str(args.pool_blocks),
    ]
    rows = [("none (stock)", run_child(__file__, "serving", True, extra))]
    for b in args.budgets:
        rows.append((f"{b:g}", run_child(__file__, "serving", False, extra + ["--budget", str(b)])))
    base = rows[0][1]
    print(f"pool {args.pool_blocks} blocks x {BLOCK} tokens; {args.requests} requests of "
          f"{args.prompt_tokens} prompt + {args.max_tokens} output tokens")
    print("| budget | req/s | ratio | out tok/s | peak running | mean KV usage |")
    print("|---|---|---|---|---|---|")
    for name, r in rows:
        ratio = r["requests_per_s"] / base["requests_per_s"]
        print(f"| {name} | {r['requests_per_s']:.3f} | {ratio:.2f}"
              f" | {r['output_tokens_per_s']:.1f} | {r['peak_running']}"
              f" | {r['mean_kv_usage']:.2f} |")


if __name__ == "__main__":
    main()
