"""Micro-timings of one layer's eviction on the CPU paged layout (no engine, one thread).

Gathers N resident tokens of one request from a paged cache in the CPU backend's ``vec``
layout (K column-major per block and head), scores them, selects, scatters the kept rows, and
compares the two ways of reading a slab permutation: ``torch.gather`` with a broadcast index
(what ``CpuKvView`` does) and ``index_select`` on the last dim (what it did before).

Usage::

    .venv/bin/python benchmarks/bench_view.py            # N = 96 (a decode eviction) and 8,192
    .venv/bin/python benchmarks/bench_view.py --out results/bench/view.md   # the committed table
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import torch

from obcache_vllm.scoring import HeadGeometry, make_pipeline, make_scorer
from obcache_vllm.vllm_ext.worker.backends.cpu import CpuKvView, PagedLayout

BS, D, HKV, HQ = 32, 64, 3, 9


def _us(fn, repeats: int) -> float:
    for _ in range(5):
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, nargs="+", default=[96, 8192])
    ap.add_argument("--out", type=Path, help="also write the table (markdown) here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    k_off = (torch.arange(D).view(1, D) * BS + torch.arange(BS).view(BS, 1)).reshape(-1)
    layout = PagedLayout(BS, D, k_off, BS * D + torch.arange(BS * D))  # the vec layout
    geom = HeadGeometry(HQ, HKV, D, D**-0.5)
    scorer, pipeline = make_scorer("obcache_key"), make_pipeline("tova", per_head=False)
    lines = [f"bench_view.py, {time.strftime('%Y-%m-%d')}, torch {torch.__version__}, one thread, "
             f"{platform.processor() or platform.machine()}", "",
             "| tokens | gather (ours) us | index_select slab us | score us | select us "
             "| scatter us |", "|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    print("\n".join(lines))
    for n in args.tokens:
        nb = -(-n // BS)
        cache = torch.randn(nb + 8, HKV, BS, 2 * D)
        view = CpuKvView(cache, layout, HKV)
        blocks = torch.arange(4, 4 + nb, dtype=torch.int32)[None]  # [1, nb]
        repeats = max(3, 3000 // nb)
        gather = _us(lambda: view.gather(blocks, n), repeats)  # noqa: B023
        slabs = view.slabs.index_select(0, blocks[0].long())
        old = _us(lambda: slabs.index_select(2, layout.k_offsets), repeats)  # noqa: B023
        k, v = (t[0].transpose(0, 1) for t in view.gather(blocks, n))  # [N, Hkv, D]
        q = torch.randn(1, HQ, D)
        pos_q, pos_k = torch.arange(n - 1, n), torch.arange(n)
        score = _us(lambda: scorer(q, k, v, geom, pos_q, pos_k), repeats)  # noqa: B023
        scores = scorer(q, k, v, geom, pos_q, pos_k)
        kept = max(21, n - BS)
        select = _us(lambda: pipeline.select(scores, keep=kept, recent=16, sinks=4), repeats)  # noqa: B023
        keep = pipeline.select(scores, keep=kept, recent=16, sinks=4)
        idx = keep.unsqueeze(-1).expand(-1, -1, D)
        kk = torch.gather(k.transpose(0, 1), 1, idx)[None]
        vv = torch.gather(v.transpose(0, 1), 1, idx)[None]
        scatter = _us(lambda: view.scatter(blocks[:, 1:], kk, vv), repeats)  # noqa: B023
        lines.append(f"| {n} | {gather:.0f} | {old:.0f} (K only) | {score:.0f} | {select:.0f} "
                     f"| {scatter:.0f} |")  # fmt: skip
        print(lines[-1])
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
