"""Prefill eviction benchmarks: stock vLLM vs obcache-vllm in the same run, ratios reported.

Two measurements, each run in fresh subprocesses (one per configuration) so that stock vLLM
(``VLLM_PLUGINS=``, plugin disabled) and the plugin engine see identical settings:

* ``overhead``: time of a prefill (+1 token) of P-token prompts: stock vLLM (a child with the
  plugin disabled), and on the plugin engine the same prompts unbudgeted and budgeted (25 %)
  with each scorer, interleaved; plus the seconds the worker itself spent scoring + compacting.
* ``serving``: a deliberately small KV pool and many long prompts; requests/s, output tokens/s
  and peak concurrently running requests, without eviction (stock) and with budgets.

Usage (the default model from ``obcache-vllm model pull``)::

    .venv/bin/python benchmarks/bench_prefill.py overhead --lengths 2048 4096
    .venv/bin/python benchmarks/bench_prefill.py serving --budgets 0.1 0.25 0.5
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

SCORERS = ("attn", "obcache_value", "obcache_key", "obcache_joint")
BLOCK = 32
MARK = "BENCH_RESULT "


def _engine(model: str, pool_blocks: int | None, max_len: int):
    from vllm import LLM

    kw = dict(model=model, dtype="float32", enforce_eager=True, max_model_len=max_len,
              block_size=BLOCK, seed=0)
    if pool_blocks:
        kw["num_gpu_blocks_override"] = pool_blocks
    return LLM(**kw)


def _prompts(tokenizer, count: int, tokens: int, seed: int) -> list[list[int]]:
    from obcache_vllm.textgen import haystack

    out = []
    for i in range(count):
        ids = tokenizer(haystack(tokens // 20, seed + i)).input_ids
        out.append(ids[:tokens])
    return out


def worker_overhead(args) -> dict:
    """Median prefill (+1 token) seconds per configuration, interleaved on the same prompts.

    Each repeat takes a fresh prompt and runs it unbudgeted first, then (plugin child) budgeted
    with every scorer: the configurations see the same tokens and the same machine load, so
    their ratios do not drift with the load. Budgeted requests never read the prefix cache, so
    the unbudgeted run before them does not help them. The plugin child also reports the
    seconds the worker spent scoring + compacting (the scheduler's totals; in-process engine).
    """
    from vllm import SamplingParams

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # to read the scheduler's totals
    llm = _engine(args.model, None, max(args.lengths) + 64)
    tok = llm.get_tokenizer()
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    totals = getattr(scheduler, "obcache_totals", None)
    configs = [None] if args.stock else [None, *SCORERS]
    times: dict[str, list[float]] = {}
    scoring: dict[str, list[float]] = {}
    warm = _prompts(tok, 1, 256, seed=1)
    for length in args.lengths:
        prompts = warm + _prompts(tok, args.repeats, length, seed=length)
        for i, prompt in enumerate(prompts):
            for scorer in configs:
                extra = None if scorer is None else {
                    "kv_budget": 0.25, "kv_scorer": scorer, "kv_pipeline": "snapkv",
                    "kv_window": 32,
                }
                params = SamplingParams(temperature=0, max_tokens=1, extra_args=extra)
                before = totals.scoring_seconds if totals is not None else 0.0
                t = time.perf_counter()
                llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
                elapsed = time.perf_counter() - t
                if i:  # the first (short) prompt warms every code path up
                    key = f"{length}:{scorer or 'none'}"
                    times.setdefault(key, []).append(elapsed)
                    if totals is not None:
                        scoring.setdefault(key, []).append(totals.scoring_seconds - before)
    return {
        "median_s": {k: sorted(v)[len(v) // 2] for k, v in times.items()},
        "scoring_s": {k: sum(v) / len(v) for k, v in scoring.items()},
    }


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


def _run_child(mode: str, stock: bool, extra: list[str]) -> dict:
    # One core by default: on a shared 2-core machine, OpenMP barriers across both cores make
    # every small op wait for a descheduled thread (set VLLM_CPU_OMP_THREADS_BIND to override).
    env = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0", **os.environ,
           "VLLM_USE_V2_MODEL_RUNNER": "0"}
    if stock:
        env["VLLM_PLUGINS"] = ""
    cmd = [sys.executable, __file__, mode, "--child"] + (["--stock"] if stock else []) + extra
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"child failed: {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    line = next(x for x in proc.stdout.splitlines() if x.startswith(MARK))
    return json.loads(line.removeprefix(MARK))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("mode", choices=["overhead", "serving"])
    ap.add_argument("--model", default=None, help="model dir (default: the provisioned model)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.1, 0.25, 0.5])
    ap.add_argument("--budget", type=float, default=None)
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--prompt-tokens", type=int, default=1536)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--pool-blocks", type=int, default=160)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--stock", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.model is None:
        from obcache_vllm import model

        args.model = str(model.pull(log=lambda m: None))
    if args.child:
        fn = worker_overhead if args.mode == "overhead" else worker_serving
        print(MARK + json.dumps(fn(args)))  # vLLM also logs to stdout
        return

    common = ["--model", args.model]
    if args.mode == "overhead":
        extra = common + ["--lengths", *map(str, args.lengths), "--repeats", str(args.repeats)]
        stock = _run_child("overhead", True, extra)["median_s"]
        result = _run_child("overhead", False, extra)
        ours, scoring = result["median_s"], result["scoring_s"]
        print(f"median of {args.repeats} prompts; snapkv, window 32, budget 25 %; "
              "ratio = budgeted / unbudgeted on the plugin engine (same prompts, interleaved)")
        print("| prompt tokens | scorer | stock vLLM s | plugin, no budget s | budgeted s "
              "| ratio | scoring+compaction s | share of prefill |")
        print("|---|---|---|---|---|---|---|---|")
        for length in args.lengths:
            base, none = stock[f"{length}:none"], ours[f"{length}:none"]
            print(f"| {length} | (none) | {base:.2f} | {none:.2f} | | {none / base:.3f} | | |")
            for scorer in SCORERS:
                key = f"{length}:{scorer}"
                t, cost = ours[key], scoring[key]
                print(f"| {length} | {scorer} | | | {t:.2f} | {t / none:.3f} | {cost:.3f} "
                      f"| {cost / t:.1%} |")
        return

    extra = common + [
        "--requests", str(args.requests), "--prompt-tokens", str(args.prompt_tokens),
        "--max-tokens", str(args.max_tokens), "--pool-blocks", str(args.pool_blocks),
    ]
    rows = [("none (stock)", _run_child("serving", True, extra))]
    for b in args.budgets:
        rows.append((f"{b:g}", _run_child("serving", False, extra + ["--budget", str(b)])))
    base = rows[0][1]
    print(f"pool {args.pool_blocks} blocks x {BLOCK} tokens; {args.requests} requests of "
          f"{args.prompt_tokens} prompt + {args.max_tokens} output tokens")
    print("| budget | req/s | ratio | out tok/s | peak running | mean KV usage |")
    print("|---|---|---|---|---|---|")
    for name, r in rows:
        ratio = r["requests_per_s"] / base["requests_per_s"]
        print(f"| {name} | {r['requests_per_s']:.3f} | {ratio:.2f} | "
              f"{r['output_tokens_per_s']:.1f} | {r['peak_running']} | {r['mean_kv_usage']:.2f} |")


if __name__ == "__main__":
    main()
