"""What attention pays when every KV head is its own sequence (per-head memory, step 2 of
docs/contributing/per_head_memory.md): vLLM's CPU attention kernel called the stock way and
regrouped, on the same cache memory, at equal kept tokens.

* **stock**: ``R`` sequences of ``Hq`` query heads over ``Hkv`` KV heads, one block table
  ``[R, blocks]`` (what vLLM's CPU backend calls, ``ops.cpu_attention_with_kv_cache``).
* **regrouped**: the same cache viewed as head-blocks ``[num_blocks * Hkv, 1, bs, 2D]`` (block
  ``b``'s head ``h`` is head-block ``b * Hkv + h``), ``R * Hkv`` sequences of ``G = Hq / Hkv``
  query heads over one KV head, a table per (request, head). Queries and outputs are permuted
  into and out of that order (counted in its time).
* **regrouped, uneven**: the same total kept tokens spread over the heads as AdaKV would
  (one head 1.6x the mean, one 0.4x): what the kernel pays for the imbalance.

Decode (one query per request) and a prefill chunk (``--chunk`` queries per request). Each
regrouped output is first checked against the stock one (equal kept tokens: the same tokens,
so the same result up to float order); the uneven layout is checked against a masked
reference. Prints a Markdown table with the ratio regrouped / stock.

Usage::

    .venv/bin/python benchmarks/bench_head_layout.py --out results/head-layout
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

HQ, HKV, D, BS = 9, 3, 64, 32  # the default model: 9 query heads, 3 KV heads, head dim 64
G = HQ // HKV


def _isa(dtype: torch.dtype) -> str:
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return _get_attn_isa(dtype, BS, D)


def attend(query, cache, block_table, seq_lens, query_lens, heads, kv_heads, isa):
    """One ``cpu_attention_with_kv_cache`` call as vLLM's CPU backend makes it.

    ``cache``: ``[blocks, kv_heads, bs, 2D]``; ``query``: ``[tokens, heads, D]`` in sequence
    order; ``query_lens``/``seq_lens``: per sequence."""
    from vllm import _custom_ops as ops

    nb, hkv, bs, _ = cache.shape
    kv = cache.view(nb, hkv, bs * 2, -1)
    key_cache, value_cache = kv.chunk(2, dim=2)
    qsl = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(query_lens, dtype=torch.int32), 0)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(seq_lens), num_heads=heads, num_kv_heads=kv_heads, head_dim=D,
        seq_lens=seq, dtype=query.dtype, query_start_loc=qsl, causal=True,
        sliding_window_size=-1, isa=isa, enable_kv_split=False,
    )  # fmt: skip
    out = torch.empty_like(query)
    ops.cpu_attention_with_kv_cache(
        query=query, key_cache=key_cache, value_cache=value_cache, output=out,
        query_start_loc=qsl, seq_lens=seq, scale=D**-0.5, causal=True, alibi_slopes=None,
        sliding_window=-1, block_table=block_table, softcap=0.0, scheduler_metadata=meta,
        s_aux=None,
    )  # fmt: skip
    return out


def setup(requests: int, widest: int, chunk: int, dtype: torch.dtype, seed: int = 0):
    """A cache with room for ``requests`` sequences of up to ``widest`` tokens per head (the
    chunk's queries included) at scattered blocks, the stock table (request r's blocks, every
    head) and the head-block table (block b's head h is head-block b * Hkv + h), and the
    chunk's queries."""
    gen = torch.Generator().manual_seed(seed)
    width = -(-widest // BS)
    blocks = requests * width + 1
    cache = (torch.randn(blocks, HKV, BS, 2 * D, generator=gen) * 0.5).to(dtype)
    order = torch.randperm(blocks - 1, generator=gen)[: requests * width] + 1  # not block 0
    stock_table = order.view(requests, width).to(torch.int32)
    head_table = torch.zeros(requests * HKV, width, dtype=torch.int32)
    for r in range(requests):
        for h in range(HKV):
            head_table[r * HKV + h] = stock_table[r] * HKV + h
    query = (torch.randn(requests * chunk, HQ, D, generator=gen) * 0.5).to(dtype)
    return cache, stock_table, head_table, query


def regroup(query: torch.Tensor, requests: int, chunk: int) -> torch.Tensor:
    """[R * T, Hq, D] -> [R * Hkv * T, G, D]: each (request, KV head) one sequence, its G query
    heads (vLLM maps query head q to KV head q // G)."""
    return (query.view(requests, chunk, HKV, G, D).permute(0, 2, 1, 3, 4)
            .reshape(requests * HKV * chunk, G, D))  # fmt: skip


def ungroup(out: torch.Tensor, requests: int, chunk: int) -> torch.Tensor:
    return (out.view(requests, HKV, chunk, G, D).permute(0, 2, 1, 3, 4)
            .reshape(requests * chunk, HQ, D))  # fmt: skip


def check_case(requests: int, tokens: int, chunk: int, dtype: torch.dtype) -> dict:
    """The case's three calls checked against each other (raises on a mismatch); returns the
    row without timings and the calls, for :func:`run_case` to time."""
    isa = _isa(dtype)
    even = [tokens] * HKV
    uneven = [int(tokens * 1.6), tokens, tokens * HKV - int(tokens * 1.6) - tokens]
    cache, stock_table, head_table, query = setup(requests, max(even + uneven), chunk, dtype)
    heads_view = cache.view(cache.shape[0] * HKV, 1, BS, 2 * D)

    def stock():
        return attend(query, cache, stock_table, [tokens] * requests, [chunk] * requests,
                      HQ, HKV, isa)  # fmt: skip

    def grouped(lengths):
        seq = [lengths[h] for _ in range(requests) for h in range(HKV)]
        q = regroup(query, requests, chunk)
        out = attend(q, heads_view, head_table, seq, [chunk] * (requests * HKV), G, 1, isa)
        return ungroup(out, requests, chunk)

    tol = 1e-4 if dtype == torch.float32 else 2e-2
    reference = stock()
    got = grouped(even)
    err = float((got.float() - reference.float()).abs().max())
    if err > tol:
        raise AssertionError(f"regrouped != stock: max |diff| {err}")
    # The uneven layout against a masked reference: head h sees its first uneven[h] tokens.
    ref_uneven = torch.cat([
        attend(query.view(requests * chunk, HKV, G, D)[:, h].contiguous(), heads_view,
               head_table[h::HKV].contiguous(), [uneven[h]] * requests, [chunk] * requests,
               G, 1, isa).view(requests * chunk, 1, G, D)
        for h in range(HKV)
    ], dim=1).view(requests * chunk, HQ, D)  # fmt: skip
    err_uneven = float((grouped(uneven).float() - ref_uneven.float()).abs().max())
    if err_uneven > tol:
        raise AssertionError(f"regrouped uneven != per-head reference: {err_uneven}")
    return {
        "requests": requests, "kept_per_head": tokens, "chunk": chunk, "dtype": str(dtype),
        "isa": isa, "max_diff": err, "max_diff_uneven": err_uneven,
        "calls": (stock, lambda: grouped(even), lambda: grouped(uneven)),
    }  # fmt: skip


def run_case(requests: int, tokens: int, chunk: int, dtype: torch.dtype, repeats: int) -> dict:
    """:func:`check_case`, then each call timed (median of five runs of ``repeats``)."""
    row = check_case(requests, tokens, chunk, dtype)
    stock, even, uneven = row.pop("calls")

    def timed(fn) -> float:
        for _ in range(3):
            fn()
        best = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(repeats):
                fn()
            best.append((time.perf_counter() - start) / repeats)
        return sorted(best)[len(best) // 2] * 1e6  # the median of five, microseconds

    t_stock, t_even, t_uneven = timed(stock), timed(even), timed(uneven)
    return {**row, "stock_us": t_stock, "regrouped_us": t_even, "uneven_us": t_uneven,
            "ratio": t_even / t_stock, "ratio_uneven": t_uneven / t_stock}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--tokens", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--chunk", type=int, default=64, help="queries per request, prefill rows")
    # bfloat16 only where the CPU has native bf16 (here it dies with an illegal instruction).
    ap.add_argument("--dtypes", nargs="+", default=["float32"])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for dtype in (getattr(torch, d) for d in args.dtypes):
        for chunk in (1, args.chunk):
            for requests in args.requests:
                for tokens in args.tokens:
                    if chunk > 1 and requests * tokens > 64 * 1024:
                        continue  # a prefill chunk of 64 long requests: not one step
                    work = requests * tokens * chunk
                    repeats = max(2, min(200, 2_000_000 // max(1, work)))
                    rows.append(run_case(requests, tokens, chunk, dtype, repeats))
                    print(json.dumps(rows[-1]), flush=True)
    lines = [
        f"`benchmarks/bench_head_layout.py`, {time.strftime('%Y-%m-%d')}, {platform.machine()}, "
        f"{args.threads} threads; Hq {HQ}, Hkv {HKV}, D {D}, block {BS}. Median of 5 timings; "
        "ratio = regrouped / stock (above 1: slower).",
        "",
        "| dtype | queries/request | requests | kept/head | stock µs | regrouped µs | ratio "
        "| uneven µs | ratio |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['dtype'].split('.')[-1]} | {r['chunk']} | {r['requests']} | "
            f"{r['kept_per_head']} | {r['stock_us']:.0f} | {r['regrouped_us']:.0f} | "
            f"{r['ratio']:.2f} | {r['uneven_us']:.0f} | {r['ratio_uneven']:.2f} |"
        )
    print("\n".join(lines))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "head_layout.json").write_text(json.dumps(rows, indent=1) + "\n")
        (args.out / "head_layout.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
