"""Unique prompts at the pool's limit: this tree against an earlier revision, interleaved.

The plugin's configuration of ``bench_serving.py``'s ``decode-bound`` and ``prefill-bound``
workloads (unique prompts, nothing shared) from two source trees, the same venv: this checkout
(``--head``, default the current HEAD) and ``--base`` (default ``21255c2``, the last revision
before budgets read and wrote vLLM's prefix cache), each checked out into a temporary worktree
so that edits in the checkout do not leak in. The two alternate, in a different order each
repeat; stock vLLM runs once per workload in the same run, for the ratios.

    .venv/bin/python benchmarks/unique_ab.py --repeats 3 --out results/bench-unique-ab

Writes ``runs.json`` (every run) and ``unique_ab.md`` (medians per arm, ratios to stock).
Run it on an otherwise idle machine: a second busy core slows the benchmark's core too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import bench_serving
import common

ROOT = Path(__file__).resolve().parents[1]
SHOWN = ("requests_per_s", "step_ms_mean", "eviction_ms_per_step", "preemptions", "max_running")


def _worktree(rev: str, where: Path) -> Path:
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(where),
                    rev], check=True, capture_output=True)  # fmt: skip
    return where


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--base", default="21255c2")
    ap.add_argument("--head", default="HEAD")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workloads", nargs="+", default=["decode-bound", "prefill-bound"])
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "bench-unique-ab")
    args = ap.parse_args()
    model = common.default_model(None)
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="unique-ab-") as tmp:
        trees = {"head": _worktree(args.head, Path(tmp) / "head"),
                 "base": _worktree(args.base, Path(tmp) / "base")}  # fmt: skip
        try:
            for rep in range(args.repeats):
                for name in args.workloads:
                    w = bench_serving.WORKLOADS[name]
                    arms = [("head", False), ("base", False)]
                    arms = arms[::-1] if rep % 2 else arms
                    arms += [("stock", True)] if rep == 0 else []
                    for arm, stock in arms:
                        tree = trees.get(arm, trees["head"])
                        result = common.run_child(
                            str(tree / "benchmarks" / "bench_serving.py"), "serving", stock,
                            ["--model", model, "--workload-json", json.dumps(asdict(w)),
                             "--pool", str(w.small_pool)],
                            env_extra={"PYTHONPATH": str(tree)},
                        )  # fmt: skip
                        result.pop("timeline")
                        runs.append({"rep": rep, "workload": name, "arm": arm, **result})
                        print(json.dumps({k: runs[-1][k] for k in ("rep", "workload", "arm",
                                                                    *SHOWN)}), flush=True)
        finally:
            for tree in trees.values():
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "-f", str(tree)],
                               capture_output=True)  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "runs.json").write_text(json.dumps(runs, indent=1) + "\n")
    (args.out / "unique_ab.md").write_text(report(runs, args))


def report(runs: list[dict], args) -> str:
    lines = [f"unique_ab.py, {time.strftime('%Y-%m-%d')}: head {args.head}, base {args.base}, "
             f"{args.repeats} repeats (stock once)", "",
             "| workload | arm | req/s per run | median | vs stock | step ms (eviction) |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for name in args.workloads:
        stock = [r for r in runs if r["workload"] == name and r["arm"] == "stock"]
        base = statistics.median(r["requests_per_s"] for r in stock) if stock else None
        for arm in ("head", "base", "stock"):
            mine = [r for r in runs if r["workload"] == name and r["arm"] == arm]
            if not mine:
                continue
            rates = [r["requests_per_s"] for r in mine]
            median = statistics.median(rates)
            lines.append(
                f"| {name} | {arm} | {', '.join(f'{x:.3f}' for x in rates)} | {median:.3f} | "
                f"{median / base:.2f}x | "
                f"{statistics.median(r['step_ms_mean'] for r in mine):.0f} "
                f"({statistics.median(r['eviction_ms_per_step'] for r in mine):.1f}) |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
