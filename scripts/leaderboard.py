#!/usr/bin/env python
"""A table in the format of kvpress's leaderboard, from the server: RULER accuracy against the
fraction of the context removed, one row per host pipeline x scorer.

kvpress's leaderboard compresses the context without its question (the question comes after
the compression) and plots the mean RULER score against the compression ratio, the fraction
of the context removed. The same here, through ``obcache-vllm serve`` and EleutherAI's
lm-evaluation-harness (``scripts/lm_eval_grid.py``): every arm sends ``kv_compress_at: -TAIL``
(the prompt is compressed TAIL tokens before its end, so RULER's question, at the end of every
prompt, is prefilled on the compressed cache) and ``kv_budget: 1 - removed`` (a fraction of
the compressed part; the TAIL tokens are kept whole).

Rows: each host (snapkv with a 32-query window and a ranking per KV head, tova with one query
and one ranking per layer, h2o with every prompt query, adakv with a 32-query window) with
each scorer of ``--scorers`` (default: ``attn``, the host's own score; ``obcache_key``, the
OBCache key score this project ships; ``dropkv``, the closest published rival), then
``random`` in snapkv (the floor) and StreamingLLM (no score). The full cache is measured once.

    make leaderboard      # .venv/bin/python scripts/leaderboard.py

Writes OUT/arms.json, lm_eval_grid's own OUT/lm_eval.{json,md} (every arm per task with
intervals and the paired difference to the full cache), OUT/LEADERBOARD.md (the table) and
OUT/leaderboard.json (its cells: ``table[row][removed]``).
``--report-only`` re-renders LEADERBOARD.md from OUT/lm_eval.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

HOSTS = {
    "snapkv": {"kv_pipeline": "snapkv", "kv_per_head": True, "kv_window": 32},
    "tova": {"kv_pipeline": "tova", "kv_per_head": False, "kv_window": 1},
    "h2o": {"kv_pipeline": "h2o", "kv_per_head": True},
    "adakv": {"kv_pipeline": "adakv", "kv_window": 32},
}
FLOORS = {
    "snapkv/random": {**HOSTS["snapkv"], "kv_scorer": "random"},
    "streaming": {"kv_pipeline": "streaming"},
}
REMOVED = (0.25, 0.5, 0.75)


def leaderboard_arms(scorers, removed=REMOVED, tail: int = 96) -> dict[str, dict]:
    """Arm name (``host/scorer/removed``) -> the kv_* fields of its requests."""
    rows = {f"{h}/{s}": {**fields, "kv_scorer": s} for h, fields in HOSTS.items() for s in scorers}
    rows.update(FLOORS)
    return {f"{row}/{r:g}": {**fields, "kv_budget": round(1 - r, 4), "kv_compress_at": -tail}
            for row, fields in rows.items() for r in removed}  # fmt: skip


def table(results: dict) -> dict[str, dict[float, dict]]:
    """``{row: {removed: {"score", "n", "kept", "diff"}}}`` from lm_eval_grid's results: the
    score is the mean accuracy over the tasks (x 100, as kvpress reports it); ``diff`` the mean
    over tasks of the paired difference to the full cache."""
    out: dict[str, dict[float, dict]] = {}
    by_arm: dict[str, list[dict]] = {}
    for row in results["rows"]:
        by_arm.setdefault(row["arm"], []).append(row)
    for arm, rows in by_arm.items():
        if arm == "full":
            name, removed = "full cache", 0.0
        else:
            name, _, removed_text = arm.rpartition("/")
            removed = float(removed_text)
        cell = {"score": 100 * sum(r["accuracy"] for r in rows) / len(rows),
                "n": sum(r["n"] for r in rows), "kept": rows[0].get("kept"),
                "tasks": {f"{r['task']}@{r['length']}": r["accuracy"] for r in rows}}  # fmt: skip
        diffs = [r["diff"] for r in rows if "diff" in r]
        if diffs:
            cell["diff"] = 100 * sum(diffs) / len(diffs)
        out.setdefault(name, {})[removed] = cell
    return out


def _cell(c: dict | None) -> str:
    """A row's score at one ratio, with its paired difference to the full cache and the kept
    fraction the server reported; empty where the arm was not run."""
    if c is None:
        return ""
    kept = "" if c["kept"] is None else f", kept {c['kept']:.2f}"
    diff = f" (Δ {c['diff']:+.1f}{kept})" if "diff" in c else ""
    return f"{c['score']:.1f}{diff}"


def render(results: dict, source: str) -> str:
    rows = table(results)
    removed = sorted({r for cells in rows.values() for r in cells if r > 0})
    tasks = sorted({t for cells in rows.values() for c in cells.values() for t in c["tasks"]})
    full = rows.get("full cache", {}).get(0.0)
    lines = [
        f"RULER through `obcache-vllm serve` ({results['model']}, lm-evaluation-harness "
        f"{results['lm_eval_version']}), {results['date']}, {results['machine']}, "
        f"{results['seconds'] / 60:.0f} min. Tasks: {', '.join(tasks)}; "
        f"{full['n'] // max(1, len(tasks)) if full else '?'} documents each, the same for every "
        "arm. The context is compressed without its question (kvpress's leaderboard setting).",
        "",
        f"Command: `{results['command']}`; per task, with intervals: `{source}/lm_eval.md`.",
        "",
        "Score: mean accuracy over the tasks x 100 (RULER's string match). Δ: the mean paired "
        "difference to the full cache over the same documents, in points. Kept: the server's "
        "mean kept fraction of the prompt (the 96-token tail, question included, is kept "
        "whole, so it is above 1 - removed).",
        "",
        "| host / scorer | " + " | ".join(f"{r:.0%} removed" for r in removed) + " |",
        "|---|" + "---|" * len(removed),
    ]
    if full:
        pad = " |" * (len(removed) - 1)
        lines.append(f"| full cache | {full['score']:.1f} (every column) |" + pad)
    for name, cells in rows.items():
        if name == "full cache":
            continue
        text = [_cell(cells.get(r)) for r in removed]
        lines.append(f"| {name} | " + " | ".join(text) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scorers", default="attn,obcache_key,dropkv")
    p.add_argument(
        "--tasks",
        default="niah_single_1,ruler_fwe",
        help="RULER tasks whose full-cache score is above chance at the length",
    )
    p.add_argument(
        "--length",
        type=int,
        default=2048,
        help="prompt length (the default model's full cache loses RULER above 2K)",
    )
    p.add_argument("--limit", type=int, default=10, help="documents per task")
    p.add_argument("--tail", type=int, default=96, help="tokens kept whole at the prompt's end")
    p.add_argument("--serve-args", default="")
    p.add_argument("--out", type=Path, default=Path("results/leaderboard"))
    p.add_argument("--report-only", action="store_true")
    args = p.parse_args(argv)
    source = str(args.out)
    if not args.report_only:
        args.out.mkdir(parents=True, exist_ok=True)
        arms = leaderboard_arms([s for s in args.scorers.split(",") if s], tail=args.tail)
        (args.out / "arms.json").write_text(json.dumps(arms, indent=1) + "\n")
        cmd = [sys.executable, str(ROOT / "scripts" / "lm_eval_grid.py"),
               "--arms", str(args.out / "arms.json"), "--tasks", args.tasks,
               "--lengths", str(args.length), "--limit", str(args.limit),
               "--max-gen-toks", "48", "--out", source]  # fmt: skip
        if args.serve_args:
            cmd += ["--serve-args", args.serve_args]
        subprocess.run(cmd, check=True)
    results = json.loads((args.out / "lm_eval.json").read_text())
    (args.out / "LEADERBOARD.md").write_text(render(results, source))
    cells = {row: {f"{r:g}": c for r, c in per.items()} for row, per in table(results).items()}
    (args.out / "leaderboard.json").write_text(json.dumps({"table": cells}, indent=1) + "\n")
    print((args.out / "LEADERBOARD.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
