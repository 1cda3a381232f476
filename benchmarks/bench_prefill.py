"""Prefill-eviction overhead: stock vLLM vs obcache-vllm in the same run, ratios reported.

Time of a prefill (+1 token) of P-token prompts: stock vLLM (a child with the plugin disabled),
and on the plugin engine the same prompts unbudgeted and budgeted (25 %, snapkv, window 32)
with each scorer, interleaved; plus the seconds the worker itself spent scoring + compacting.
Memory-bound serving (requests/s, peak concurrency, latency) is ``bench_serving.py``.

Usage (the default model from ``obcache-vllm model pull``)::

    .venv/bin/python benchmarks/bench_prefill.py --lengths 2048 4096
"""

from __future__ import annotations

import os
import time

import common


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
    llm = common.engine(args.model, None, max(args.lengths) + 64)
    tok = llm.get_tokenizer()
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    totals = getattr(scheduler, "obcache_totals", None)
    configs = [None] if args.stock else [None, *common.SCORERS]
    times: dict[str, list[float]] = {}
    scoring: dict[str, list[float]] = {}
    warm = common.prompts(tok, 1, 256, seed=1)
    for length in args.lengths:
        prompts = warm + common.prompts(tok, args.repeats, length, seed=length)
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


def main() -> None:
    ap = common.parser(__doc__, "overhead")
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--repeats", type=int, default=2, help="prompts per length (median)")
    args = common.parse(ap, worker_overhead)
    if args is None:
        return

    extra = ["--model", args.model, "--lengths", *map(str, args.lengths),
             "--repeats", str(args.repeats)]
    stock = common.run_child(__file__, "overhead", True, extra)["median_s"]
    result = common.run_child(__file__, "overhead", False, extra)
    ours, scoring = result["median_s"], result["scoring_s"]
    print(f"median of {args.repeats} prompts; snapkv, window 32, budget 25 %; "
          "ratio = budgeted / unbudgeted on the plugin engine (same prompts, interleaved)")
    print("| prompt tokens | scorer | stock vLLM s | plugin, no budget s | budgeted s "
          "| ratio | scoring+compaction s | share of prefill |")
    print("|---|---|---|---|---|---|---|---|")
    for length in args.lengths:
        base, none = stock[f"{length}:none"], ours[f"{length}:none"]
        print(f"| {length} | (none) | {base:.2f} | {none:.2f} | | {none / base:.3f} | | |")
        for scorer in common.SCORERS:
            key = f"{length}:{scorer}"
            t, cost = ours[key], scoring[key]
            print(f"| {length} | {scorer} | | | {t:.2f} | {t / none:.3f} | {cost:.3f} "
                  f"| {cost / t:.1%} |")


if __name__ == "__main__":
    main()
