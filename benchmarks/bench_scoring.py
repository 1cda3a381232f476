"""Scoring cost per layer: every scorer, in milliseconds and as a ratio to ``attn``.

SmolLM2-135M geometry by default (9 query heads, 3 KV heads, head dim 64). Inputs are random:
q [W, Hq, D], k/v [T, Hkv, D] in the chosen dtype (the vLLM CPU cache is bf16), laid out either
per head (a ``transpose(0, 1)`` view of a contiguous [Hkv, T, D] tensor: what a gather from the
paged cache can produce for free, and what the scorers read without a copy) or interleaved
(contiguous [T, Hkv, D]: the scorers copy it once per call). Each cell is the minimum (default) or
median over repeated calls after one warm-up call; on a shared 2-core machine the minimum is the
stabler estimate of the cost. ``select_keep`` (keeping T/2 with a 64-entry recent window) is timed
alongside for scale.

    python benchmarks/bench_scoring.py                       # 1 thread, then default threads
    python benchmarks/bench_scoring.py --threads 1 --T 4096 --W 1 --dtype bfloat16

Prints one Markdown table per (threads, dtype, layout) with the machine's load average.
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import statistics
import time

import torch

from obcache_vllm.scoring import SCORER_NAMES, HeadGeometry, make_scorer, select_keep

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--T", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--W", type=int, nargs="+", default=[1, 32, 64])
    parser.add_argument("--scores", nargs="+", default=list(SCORER_NAMES), choices=SCORER_NAMES)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 0], help="0 = default")
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=DTYPES)
    parser.add_argument(
        "--layout", nargs="+", default=["per-head"], choices=["per-head", "interleaved"]
    )
    parser.add_argument("--stat", default="min", choices=["min", "median"])
    parser.add_argument("--q-heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--min-time", type=float, default=0.3, help="seconds per cell, at least")
    parser.add_argument("--min-reps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def time_ms(fn, args: argparse.Namespace) -> float:
    fn()  # warm-up: first-call allocations and kernel selection
    times = []
    start = time.perf_counter()
    while len(times) < args.min_reps or time.perf_counter() - start < args.min_time:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    stat = min if args.stat == "min" else statistics.median
    return 1e3 * stat(times)


def make_kv(geom: HeadGeometry, num_t: int, dtype, layout: str, gen) -> torch.Tensor:
    if layout == "per-head":
        x = torch.randn(geom.num_kv_heads, num_t, geom.head_dim, generator=gen)
        return x.to(dtype).transpose(0, 1)  # [T, Hkv, D] view of [Hkv, T, D]
    return torch.randn(num_t, geom.num_kv_heads, geom.head_dim, generator=gen).to(dtype)


def bench_table(args, geom: HeadGeometry, dtype: torch.dtype, layout: str) -> list[str]:
    header = ["T", "W"] + [f"{name} ms (x attn)" for name in args.scores] + ["select_keep ms"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    gen = torch.Generator().manual_seed(args.seed)
    for num_t in args.T:
        k = make_kv(geom, num_t, dtype, layout, gen)
        v = make_kv(geom, num_t, dtype, layout, gen)
        for num_w in args.W:
            q = 2.0 * torch.randn(num_w, geom.num_q_heads, geom.head_dim, generator=gen)
            q = q.to(dtype)
            cost = {
                name: time_ms(functools.partial(make_scorer(name), q, k, v, geom), args)
                for name in args.scores
            }
            base = cost.get("attn")
            cells = [str(num_t), str(num_w)]
            for name in args.scores:
                ratio = f" ({cost[name] / base:.2f}x)" if base else ""
                cells.append(f"{cost[name]:.2f}{ratio}")
            scores = torch.rand(geom.num_kv_heads, num_t, generator=gen)
            keep = num_t // 2
            select = functools.partial(select_keep, scores, keep=keep, recent=min(64, keep))
            cells.append(f"{time_ms(select, args):.2f}")
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    args = parse_args()
    geom = HeadGeometry(args.q_heads, args.kv_heads, args.head_dim)
    default_threads = torch.get_num_threads()
    print(
        f"torch {torch.__version__}, {platform.machine()}, {os.cpu_count()} CPUs, default "
        f"threads {default_threads}, Hq={geom.num_q_heads} Hkv={geom.num_kv_heads} "
        f"D={geom.head_dim}, {args.stat} of >= {args.min_reps} calls"
    )
    for threads in args.threads:
        torch.set_num_threads(threads or default_threads)
        for dtype_name in args.dtype:
            for layout in args.layout:
                load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
                print(
                    f"\n### threads={torch.get_num_threads()} inputs={dtype_name} "
                    f"layout={layout} (load average {load})\n"
                )
                table = bench_table(args, geom, DTYPES[dtype_name], layout)
                print("\n".join(table), flush=True)
    torch.set_num_threads(default_threads)


if __name__ == "__main__":
    main()
