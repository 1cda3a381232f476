"""Long-prompt prefill with a bounded peak (kv_prefill_evict) vs stock vLLM, in one run.

One P-token prompt (default 8,000) prefilled in chunks of C tokens (default 512), timed from
submission to its first generated token; each configuration in a fresh child on one
core, the same prompts:

* ``stock``: stock vLLM (``VLLM_PLUGINS=``), a pool that holds the prompt;
* ``obcache, same pool``: the plugin, budget B (default 10 % of the prompt) with
  ``kv_prefill_evict``: every chunk attends to at most B + 32 + C keys instead of the whole
  prefix, and the scorer + compaction run after every chunk;
* ``obcache, small pool``: the same in a pool of ``--small-pool`` blocks (default 128 = 4,096
  tokens, half the prompt: stock vLLM refuses to start with it).

Reported: prefill seconds (median of ``--repeats``), the ratio to stock, the worker's eviction
seconds, evictions, and the most blocks the request held.

Usage::

    .venv/bin/python benchmarks/bench_long_prefill.py                  # 8,000 tokens, 3 repeats
    .venv/bin/python benchmarks/bench_long_prefill.py --tokens 4000 --repeats 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import common


def worker(args) -> dict:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # to read the scheduler each step
    llm = common.engine(args.model, args.pool, args.tokens + 64, max_num_batched_tokens=args.chunk)
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    manager = scheduler.kv_cache_manager.coordinator.single_type_managers[0]
    totals = getattr(scheduler, "obcache_totals", None)
    prompts = common.prompts(llm.get_tokenizer(), args.repeats + 1, args.tokens, seed=9)
    kv = None
    if not args.stock:
        kv = {"kv_budget": args.budget, "kv_prefill_evict": True, "kv_pipeline": args.pipeline,
              "kv_scorer": args.scorer, "kv_window": args.window}  # fmt: skip
    # Two tokens, so the request still holds its blocks after the step of the first one (the
    # time measured); DELTA outputs, so that step is seen.
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, extra_args=kv,
                            output_kind=RequestOutputKind.DELTA)
    times, evict_s, evictions, peak = [], [], [], 0
    for i, prompt in enumerate(prompts):
        before = (totals.scoring_seconds, totals.evictions) if totals else (0.0, 0)
        start, first = time.perf_counter(), None
        rid = engine.add_request(f"p{i}", {"prompt_token_ids": prompt}, params.clone())
        while engine.has_unfinished_requests():
            outs = engine.step()
            if first is None and any(o.outputs[0].token_ids for o in outs):
                first = time.perf_counter() - start
                if totals:
                    after = (totals.scoring_seconds, totals.evictions)
            held = sum(1 for b in manager.req_to_blocks.get(rid, ()) if not b.is_null)
            peak = max(peak, held) if i else peak
        if i:  # the first prompt warms every code path up
            times.append(first)
            if totals:
                evict_s.append(after[0] - before[0])
                evictions.append(after[1] - before[1])
    return {
        "prefill_s": statistics.median(times),
        "eviction_s": statistics.median(evict_s) if evict_s else 0.0,
        "evictions": statistics.median(evictions) if evictions else 0,
        "peak_blocks": peak,
    }


def main() -> None:
    ap = common.parser(__doc__, "long")
    ap.add_argument("--tokens", type=int, default=8000)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--budget", type=float, default=0.1)
    ap.add_argument("--pipeline", default="snapkv")
    ap.add_argument("--scorer", default="obcache_key")
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--small-pool", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--pool", type=int, help=argparse.SUPPRESS)
    args = common.parse(ap, worker)
    if args is None:
        return
    big = -(-(args.tokens + 64) // common.BLOCK) + 8
    extra = ["--model", args.model, "--tokens", str(args.tokens), "--chunk", str(args.chunk),
             "--budget", str(args.budget), "--pipeline", args.pipeline, "--scorer", args.scorer,
             "--window", str(args.window), "--repeats", str(args.repeats)]  # fmt: skip
    rows = {
        "stock": common.run_child(__file__, "long", True, extra + ["--pool", str(big)]),
        "obcache, same pool": common.run_child(__file__, "long", False,
                                               extra + ["--pool", str(big)]),
        "obcache, small pool": common.run_child(__file__, "long", False,
                                                extra + ["--pool", str(args.small_pool)]),
    }  # fmt: skip
    base = rows["stock"]["prefill_s"]
    print(f"{args.tokens}-token prompt, chunks of {args.chunk}, budget {args.budget:g} "
          f"({args.pipeline} + {args.scorer}, window {args.window}), median of {args.repeats}; "
          f"pools: {big} blocks, small {args.small_pool} blocks of {common.BLOCK} tokens")
    print("| config | pool blocks | prefill s | ratio to stock | eviction s | evictions "
          "| most blocks held |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        pool = args.small_pool if "small" in name else big
        print(f"| {name} | {pool} | {r['prefill_s']:.2f} | {r['prefill_s'] / base:.3f} "
              f"| {r['eviction_s']:.2f} | {r['evictions']:.0f} | {r['peak_blocks']} |")


if __name__ == "__main__":
    main()
