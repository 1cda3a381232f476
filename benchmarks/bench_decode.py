"""Decode latency with decode-time eviction vs stock vLLM, at the same number of generated tokens.

One request at a time: a P-token prompt (default 256), then G generated tokens (default 1024,
``ignore_eos``, greedy). The engine is stepped by hand (in-process engine core) and every step
is timed; the first step (the prefill) is excluded. Configurations, each in a fresh child:

* ``stock``: stock vLLM (``VLLM_PLUGINS=``), no budget: the cache grows to P + G tokens;
* ``plugin, no budget``: the plugin installed, the request unbudgeted (the plugin's fixed cost);
* ``h2o+<scorer>``: budget B (default 256) with ``kv_decode``: running H2O scores of each
  scorer, a whole block evicted whenever the cache holds one over budget.

Eviction cost: the worker times the scoring and compaction in every attention layer and reports
it to the scheduler (``obcache_totals.scoring_seconds``); divided by the decode steps it is the
amortised eviction cost per step (most steps only buffer the query; every 64 steps the buffer is
scored, every 32 tokens a block is evicted).

Usage (the default model from ``obcache-vllm model pull``)::

    .venv/bin/python benchmarks/bench_decode.py                     # P=256, G=1024, B=256
    .venv/bin/python benchmarks/bench_decode.py --generate 2048 --budget 512 --repeats 2
"""

from __future__ import annotations

import os
import statistics
import time

import common
from common import SCORERS, run_child
from common import engine as make_engine
from common import prompts as make_prompts


def _configs(stock: bool, budget: int) -> dict[str, dict | None]:
    if stock:
        return {"stock": None}
    out: dict[str, dict | None] = {"plugin, no budget": None}
    for s in SCORERS:
        out[f"h2o+{s}"] = {"kv_budget": budget, "kv_pipeline": "h2o", "kv_scorer": s,
                           "kv_decode": True}
    return out


def _one_request(llm, prompt: list[int], params) -> list[float]:
    """Seconds of each engine step after the first (the prefill) for one request."""
    engine = llm.llm_engine
    engine.add_request(f"r{time.monotonic_ns()}", {"prompt_token_ids": prompt}, params)
    times = []
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return times[1:]


def worker(args) -> dict:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # to read the scheduler's totals
    llm = make_engine(args.model, None, args.prompt_tokens + args.generate + 64)
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    prompts = make_prompts(llm.get_tokenizer(), args.repeats + 1, args.prompt_tokens, seed=3)
    results = {}
    for name, kv in _configs(args.stock, args.budget).items():
        def params(n, kv=kv):
            return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, extra_args=kv,
                                  output_kind=RequestOutputKind.FINAL_ONLY)

        _one_request(llm, prompts[0], params(64))  # warm-up (also the scorer's first call)
        totals = getattr(scheduler, "obcache_totals", None)
        score0 = totals.scoring_seconds if totals else 0.0
        evict0 = totals.evictions if totals else 0
        steps: list[float] = []
        for p in prompts[1:]:
            steps += _one_request(llm, p, params(args.generate))
        steps_sorted = sorted(steps)
        results[name] = {
            "steps": len(steps),
            "mean_s": statistics.fmean(steps),
            "median_s": statistics.median(steps),
            "p99_s": steps_sorted[min(len(steps) - 1, int(0.99 * len(steps)))],
            "eviction_s_per_step": ((totals.scoring_seconds - score0) / len(steps)
                                    if totals else 0.0),
            "evictions": (totals.evictions - evict0) if totals else 0,
        }
    return results


def main() -> None:
    ap = common.parser(__doc__, "decode")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--generate", type=int, default=1024, help="generated tokens per request")
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=1, help="measured requests per configuration")
    args = common.parse(ap, worker)
    if args is None:
        return

    extra = ["--model", args.model, "--prompt-tokens", str(args.prompt_tokens),
             "--generate", str(args.generate), "--budget", str(args.budget),
             "--repeats", str(args.repeats)]
    rows = {**run_child(__file__, "decode", True, extra),
            **run_child(__file__, "decode", False, extra)}
    base = rows["stock"]["mean_s"]
    print(f"prompt {args.prompt_tokens} tokens, {args.generate} generated x {args.repeats}; "
          f"budget {args.budget} (h2o, kv_decode); threads bound to "
          f"{os.environ.get('VLLM_CPU_OMP_THREADS_BIND', '0')}")
    print("| config | mean ms/step | ratio to stock | median ms | p99 ms "
          "| eviction ms/step (amortised) | evictions |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        print(f"| {name} | {1e3 * r['mean_s']:.1f} | {r['mean_s'] / base:.3f} "
              f"| {1e3 * r['median_s']:.1f} | {1e3 * r['p99_s']:.1f} "
              f"| {1e3 * r['eviction_s_per_step']:.2f} | {r['evictions']} |")


if __name__ == "__main__":
    main()
