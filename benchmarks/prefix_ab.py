"""Before/after table of ``bench_prefix.py`` runs: follow-up TTFT p50 and request throughput of
each arm relative to the stock arm of the same run.

    .venv/bin/python benchmarks/prefix_ab.py results/bench-prefix-ab

reads ``before<N>/prefix.json`` and ``after<N>/prefix.json`` under the directory (each one run
of ``bench_prefix.py --out DIR/before1`` etc.; a "before" run comes from a checkout of the older
commit, e.g. ``git worktree add ../before <commit>``, run with ``PYTHONPATH`` set to it) and
writes ``ab.md`` and ``ab.json`` there.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def ratios(run: Path) -> dict[tuple[str, str], tuple[float, float, int]]:
    """(workload, arm) -> (follow-up TTFT p50 / stock's, req/s / stock's, follow-ups reusing)."""
    summaries = [a["summary"] for a in json.loads((run / "prefix.json").read_text())]
    stock = {s["workload"]: s for s in summaries if s["arm"] == "stock"}
    out = {}
    for s in summaries:
        if s["arm"] == "stock":
            continue
        base = stock[s["workload"]]
        out[(s["workload"], s["arm"])] = (
            s["followup_ttft_p50"] / base["followup_ttft_p50"],
            s["request_throughput"] / base["request_throughput"],
            s["reused_followups"],
        )
    return out


def main(directory: str) -> str:
    root = Path(directory)
    runs = {side: [ratios(p) for p in sorted(root.glob(f"{side}[0-9]*")) if p.is_dir()]
            for side in ("before", "after")}  # fmt: skip
    keys = sorted({k for side in runs.values() for r in side for k in r})
    lines = [
        "| workload | arm | follow-up TTFT p50 vs stock: before (each run) | after | "
        "req/s vs stock: before | after | follow-ups reusing an entry: before / after |",
        "|---|---|---|---|---|---|---|",
    ]
    table = {}
    for key in keys:
        cells = {side: [r[key] for r in runs[side] if key in r] for side in runs}
        table["|".join(key)] = cells

        def join(side, i, cells=cells):
            return " / ".join(f"{c[i]:.2f}x" for c in cells[side]) or "-"

        reuse = " / ".join(str(cells[side][0][2]) if cells[side] else "-" for side in runs)
        lines.append(f"| {key[0]} | {key[1]} | {join('before', 0)} | {join('after', 0)} | "
                     f"{join('before', 1)} | {join('after', 1)} | {reuse} |")  # fmt: skip
    text = "\n".join(lines) + "\n"
    (root / "ab.md").write_text(text)
    (root / "ab.json").write_text(json.dumps(table, indent=1) + "\n")
    return text


if __name__ == "__main__":
    print(main(sys.argv[1] if len(sys.argv) > 1 else "results/bench-prefix-ab"))
