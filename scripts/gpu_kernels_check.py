"""What a bare GPU machine (PyTorch, no vLLM, no network) can check, printed as one table.

1. FlashAttention's paged KV layout of vLLM 0.32 on the device: the view's gather/scatter on
   every KV cache layout, and the in-place read shift against a pure-torch paged-attention
   reference (obcache_vllm.evidence.kernel_checks.paged), in fp16 and bf16.
2. The scorers on the device against fp64 on CPU (exactness and kept-set agreement).
3. The scorers' cost against a same-shape ``scaled_dot_product_attention`` prefill
   (Llama-3.1-8B layer geometry: 32 query heads, 8 KV heads, head dim 128; W = 64).

    python scripts/gpu_kernels_check.py                      # CUDA, T = 4K 8K 16K 32K
    python scripts/gpu_kernels_check.py --device cpu --tokens 512 1024   # a CPU smoke run

Exit status 1 if any bounded row fails (speed rows are information, never a failure).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the source tree, not installed

from obcache_vllm.evidence.kernel_checks import Row, format_table, paged, scorers, worst_by  # noqa: E402
from obcache_vllm.scoring import HeadGeometry  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    parser.add_argument("--exact-tokens", type=int, default=None, help="default: min(--tokens)")
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--gpu-chunk", type=int, default=1 << 26,
        help="also time the scorers with this chunk_elements (0: only the default)",
    )  # fmt: skip
    parser.add_argument("--skip-speed", action="store_true")
    return parser.parse_args()


def describe(device: torch.device) -> str:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return (
            f"{props.name}, {props.total_memory / 2**30:.0f} GiB, torch {torch.__version__}, "
            f"CUDA {torch.version.cuda}"
        )
    return f"{platform.processor() or platform.machine()}, torch {torch.__version__}"


def summarize_paged(rows: list[Row]) -> list[Row]:
    """One row per (check, dtype, metric) over every layout and request: the worst one,
    its layout and request named in the note."""
    worst = worst_by(rows, key=lambda r: (r.check, r.case.split()[1], r.metric))
    count = len(paged.LAYOUT_ORDERS)
    return [
        Row(r.check, f"{count} layouts, {r.case.split()[1]}", r.metric, r.value, r.bound,
            r.limit, f"worst: {r.case}")  # fmt: skip
        for r in worst
    ]


def pivot_speed(rows: list[Row]) -> list[Row]:
    """One row per (T, chunk): the SDPA prefill ms, each scorer in ms and % of it in the note."""
    out: list[Row] = []
    for r in rows:
        if r.metric == "sdpa prefill ms":
            out.append(Row("speed", r.case, "sdpa prefill ms (scorers: note)", r.value))
            continue
        last = out[-1]
        name = r.metric.removesuffix(" ms").removeprefix("obcache_")
        part = f"{name} {r.value:.3g} ms ({100 * r.value / last.value:.1f}%)"
        note = f"{last.note}, {part}" if last.note else part
        out[-1] = Row(last.check, last.case, last.metric, last.value, note=note)
    return out


def main() -> int:
    args = parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device visible to torch; use --device cpu for a smoke run")
        return 2
    torch.manual_seed(0)
    start = time.perf_counter()
    geom = HeadGeometry(args.q_heads, args.kv_heads, args.head_dim)
    rows = summarize_paged(paged.run_all(device))
    exact_t = args.exact_tokens or min(args.tokens)
    for dtype in (torch.float32, torch.bfloat16):
        rows += scorers.check_exactness(device, geom, exact_t, args.window, dtype)
    if not args.skip_speed:
        chunks = [None] + ([args.gpu_chunk] if args.gpu_chunk else [])
        for tokens in args.tokens:
            for chunk in chunks:
                rows += pivot_speed(
                    scorers.time_scorers(
                        device, geom, tokens, args.window, chunk_elements=chunk,
                        repeats=args.repeats,
                    )
                )  # fmt: skip
    print(f"# gpu_kernels_check on {describe(device)}")
    print(f"# geometry Hq={geom.num_q_heads} Hkv={geom.num_kv_heads} D={geom.head_dim}; "
          f"{time.perf_counter() - start:.1f} s")  # fmt: skip
    print(format_table(rows))
    failed = [r for r in rows if not r.ok]
    print(f"\n{len(rows) - len(failed)}/{len(rows)} rows ok" + (" - FAILED" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
