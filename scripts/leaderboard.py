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


def _minutes(results: dict) -> str:
    interrupted = results.get("interrupted")
    if interrupted:  # a resumed run: the parts that were cut off recorded no time
        return (f"resumed ({len(interrupted)} arms from runs that were cut off, whose time "
                "and kept fractions were not recorded)")
    return f"{results['seconds'] / 60:.0f} min"


def render(results: dict, source: str) -> str:
    rows = table(results)
    removed = sorted({r for cells in rows.values() for r in cells if r > 0})
    tasks = sorted({t for cells in rows.values() for c in cells.values() for t in c["tasks"]})
    full = rows.get("full cache", {}).get(0.0)
    lines = [
        f"RULER through `obcache-vllm serve` ({results['model']}, lm-evaluation-harness "
        f"{results['lm_eval_version']}), {results['date']}, {results['machine']}, "
        f"{_minutes(results)}. Tasks: {', '.join(tasks)}; "
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


def _is_floor(arm: str) -> bool:
    """An arm of a FLOORS row (``snapkv/random/0.5``, ``streaming/0.5``)."""
    return arm.rpartition("/")[0] in FLOORS


def _parts(out: Path) -> list[Path]:
    return sorted(p for p in out.glob("part-*") if p.is_dir())


def _raw_dirs(out: Path, arm: str) -> list[Path]:
    """Where an arm's lm-eval output may lie: the first run's ``raw``, then each part's."""
    safe = arm.replace("/", "_")
    return [d / "raw" / safe for d in (out, *_parts(out)) if (d / "raw" / safe).is_dir()]


def finished(out: Path, arms: dict, tasks: list[str], length: int) -> set[str]:
    """The arms (and ``full``) whose lm-eval samples of every task lie under ``out``."""
    done = set()
    for name in ("full", *arms):
        for raw in _raw_dirs(out, name):
            files = list((raw / str(length)).rglob("samples_*.jsonl"))
            if all(any(f.name.startswith(f"samples_{t}_") for f in files) for t in tasks):
                done.add(name)
    return done


def merge(out: Path, arms: dict, length: int) -> None:
    """OUT/lm_eval.json (and .md) from every arm's samples under ``out``: the first run's and
    each part's; an arm's kept fraction and command come from the part that ran it (an
    interrupted first run recorded none)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import lm_eval_grid as grid

    parts = [json.loads((p / "lm_eval.json").read_text()) for p in _parts(out)
             if (p / "lm_eval.json").is_file()]  # fmt: skip
    runs = {}
    for name in ("full", *arms):
        scores = {}
        for raw in _raw_dirs(out, name):
            for task, per in grid.read_samples(raw / str(length), [length]).items():
                scores.setdefault(task, {}).update(per)
        if not scores:
            continue
        ran = next((p["runs"][name] for p in reversed(parts) if name in p["runs"]), {})
        runs[name] = {"fields": arms.get(name, {"kv_budget": None}), "scores": scores,
                      "command": ran.get("command"), "seconds": ran.get("seconds"),
                      "kept_ratio": ran.get("kept_ratio")}  # fmt: skip
    last = parts[-1]
    results = {
        "command": "python scripts/leaderboard.py --resume, after runs that were cut off; "
                   "the parts that finished: " + "; ".join(p["command"] for p in parts),
        "date": last["date"], "machine": last["machine"], "model": last["model"],
        "lm_eval_version": last["lm_eval_version"],
        "seconds": sum(p["seconds"] for p in parts),
        "arms": list(runs), "runs": runs,
        "interrupted": [n for n, r in runs.items() if r["command"] is None],
    }  # fmt: skip
    results["rows"] = grid.summarize(runs)
    results["versus"] = grid.versus(runs)
    for run in runs.values():  # JSON keys are strings
        run["scores"] = {t: {str(n): d for n, d in per.items()} for t, per in run["scores"].items()}
    (out / "lm_eval.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "lm_eval.md").write_text(grid.render(results))


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
    p.add_argument("--resume", action="store_true",
                   help="keep the arms whose samples OUT already holds (an interrupted run's); "
                        "run the rest (the floors first) into OUT/part-N and merge")
    args = p.parse_args(argv)
    source = str(args.out)
    arms = leaderboard_arms([s for s in args.scorers.split(",") if s], tail=args.tail)
    if not args.report_only:
        args.out.mkdir(parents=True, exist_ok=True)
        tasks = args.tasks.split(",")
        done = finished(args.out, arms, tasks, args.length) if args.resume else set()
        todo = {n: f for n, f in arms.items() if n not in done}
        todo = dict(sorted(todo.items(), key=lambda kv: not _is_floor(kv[0])))
        part = args.out if not args.resume else args.out / f"part-{len(_parts(args.out)) + 1}"
        part.mkdir(parents=True, exist_ok=True)
        (part / "arms.json").write_text(json.dumps(todo, indent=1) + "\n")
        cmd = [sys.executable, str(ROOT / "scripts" / "lm_eval_grid.py"),
               "--arms", str(part / "arms.json"), "--tasks", args.tasks,
               "--lengths", str(args.length), "--limit", str(args.limit),
               "--max-gen-toks", "48", "--out", str(part)]  # fmt: skip
        if "full" in done:
            cmd.append("--no-full")
        if args.serve_args:
            cmd += ["--serve-args", args.serve_args]
        subprocess.run(cmd, check=True)
        if args.resume:
            merge(args.out, arms, args.length)
    results = json.loads((args.out / "lm_eval.json").read_text())
    (args.out / "LEADERBOARD.md").write_text(render(results, source))
    cells = {row: {f"{r:g}": c for r, c in per.items()} for row, per in table(results).items()}
    (args.out / "leaderboard.json").write_text(json.dumps({"table": cells}, indent=1) + "\n")
    print((args.out / "LEADERBOARD.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
