"""Budgets with an fp8 KV cache: four configurations at the same pool *bytes*, in one run.

Every configuration gets the same KV memory, so an fp8 cache (1 byte per value) has 4x the
blocks of the default fp32 cache (this CPU runs the model in fp32; a bf16 model would give
fp8 2x). All requests arrive at t = 0, enough of them that the pool limits concurrency in every
configuration (the fp8 pool too):

* ``stock, auto``     - stock vLLM (``VLLM_PLUGINS=``), ``--kv-cache-dtype auto`` (fp32);
* ``stock, fp8``      - stock vLLM, ``--kv-cache-dtype fp8``, 4x the blocks;
* ``budget, auto``    - obcache-vllm, the budget on every request, fp32 cache;
* ``budget, fp8``     - obcache-vllm, the budget, fp8 cache, 4x the blocks.

Each runs in a fresh child on one core (``bench_serving.py``'s worker: requests/s, output
tokens/s, running requests, preemptions, TTFT/TPOT, step time split into model and eviction).
Reported: the table and the ratios the fp8 question asks for (budget+fp8 against stock fp8,
and against the budget with the fp32 cache at the same bytes).

Usage::

    .venv/bin/python benchmarks/bench_kv_dtype.py                 # ~15 minutes
    .venv/bin/python benchmarks/bench_kv_dtype.py --repeats 3     # medians of 3

Outputs: ``results/bench-kv-dtype/kv_dtype.json`` and ``kv_dtype.md``.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, replace
from pathlib import Path

import bench_serving as serving
import common

# The server's shipped pipeline (configs/default.yaml), a quarter of each prompt kept.
KV = {"kv_budget": 0.25, **serving.TOVA_KEY}
# 24 x (1024 + 128): fp32 pool of 100 blocks (3,200 tokens: stock holds 2 requests), fp8 pool
# of 400 (12,800 tokens: stock holds 11 of the 24).
WORKLOAD = serving.Workload(24, 1024, 128, KV, 100, 400,
                            note="a quarter of each prompt kept, the same pool bytes")
FP8_FACTOR = 4  # fp32 values -> one byte


def configs(w: serving.Workload, pool: int) -> list[tuple[str, bool, int, serving.Workload]]:
    fp8 = replace(w, engine={"kv_cache_dtype": "fp8"})
    return [("stock, auto", True, pool, w), ("stock, fp8", True, pool * FP8_FACTOR, fp8),
            ("budget, auto", False, pool, w),
            ("budget, fp8", False, pool * FP8_FACTOR, fp8)]  # fmt: skip


def table(w: serving.Workload, rows: dict[str, dict]) -> str:
    lines = [
        f"{w.requests} x ({w.prompt_tokens} prompt + {w.max_tokens} generated), kv "
        f"{json.dumps(w.kv)}; " + ", ".join(f"{k}: {r['pool_blocks']} blocks"
                                            for k, r in rows.items()) + f". {w.note}",
        "",
        *serving.TABLE_HEAD,
    ]
    lines += [serving.table_row(label, r, w) for label, r in rows.items()]
    ratio = {k: rows["budget, fp8"]["requests_per_s"] / rows[k]["requests_per_s"]
             for k in rows if k != "budget, fp8"}  # fmt: skip
    lines += ["", "Request throughput of budget + fp8, same pool bytes: "
              + ", ".join(f"{v:.2f}x {k}" for k, v in ratio.items())]  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    ap = common.parser(__doc__, "kv_dtype")
    ap.add_argument("--repeats", type=int, default=1, help="runs per configuration (median)")
    ap.add_argument("--pool", type=int, default=WORKLOAD.small_pool,
                    help="blocks of the fp32 pool (the fp8 pool gets 4x)")
    ap.add_argument("--out", default="results/bench-kv-dtype")
    args = common.parse(ap, None)
    w = replace(WORKLOAD, small_pool=args.pool, big_pool=args.pool * FP8_FACTOR)
    core = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0")
    header = (f"bench_kv_dtype.py, {time.strftime('%Y-%m-%d')}, fp32 model, block 32, one core "
              f"(VLLM_CPU_OMP_THREADS_BIND={core}), repeats {args.repeats}")
    print(header, flush=True)
    rows: dict[str, dict] = {}
    for label, stock, pool, config in configs(w, args.pool):
        spec = json.dumps(asdict(config))
        runs = [common.run_child(serving.__file__, "serving", stock,
                                 ["--model", args.model, "--workload-json", spec,
                                  "--pool", str(pool)])
                for _ in range(args.repeats)]  # fmt: skip
        rows[label] = serving._median_run(runs)
        rows[label]["pool_blocks"] = pool
        print(f"  {label} done ({rows[label]['wall_s']:.0f} s)", flush=True)
    text = table(w, rows)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kv_dtype.json").write_text(json.dumps(
        {"header": header, "workload": asdict(w), "results": rows}, indent=1))  # fmt: skip
    (out / "kv_dtype.md").write_text(header + "\n\n" + text + "\n")
    print(f"wrote {out}/kv_dtype.json and .md")


if __name__ == "__main__":
    main()
