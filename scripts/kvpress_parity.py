#!/usr/bin/env python
"""Parity of our ``snapkv + attn`` with NVIDIA kvpress's SnapKV press, on the same prompts.

Three runs of the same cells (``obcache-vllm eval``'s tasks, the same samples, the same kept
counts, greedy):

1. **vLLM**: ``obcache-vllm eval run`` (this project, in vLLM, kv_pipeline snapkv, kv_scorer
   attn, per KV head, ``--window``);
2. **kvpress**: ``obcache-vllm eval kvpress`` (kvpress 0.5.5's ``SnapKVPress`` on HF
   transformers, as published: the last ``window`` queries' attention over the tokens before
   the window, averaged, avg-pooled with kernel 5; the window itself always kept);
3. **kvpress, our rule**: ``obcache-vllm eval kvpress --rule obcache`` (the same press with
   this project's snapkv rule: the window's tokens scored like any other, max-pooled with kernel
   7, 4 sinks and 16 recent tokens always kept; ``kvpress_runner.obcache_rule_snapkv``).

(1) against (3) differ only in the engine: that pair is the parity check (within ±0.02 of
accuracy, or the difference is reported). (2) against (3) differ only in the rule: the
difference a user sees between this project and kvpress's SnapKV.

    .venv/bin/python scripts/kvpress_parity.py            # needs scripts/kvpress_venv.sh first
    .venv/bin/python scripts/kvpress_parity.py --report-only
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from obcache_vllm.evidence.eval.cells import Cell, load_results  # noqa: E402
from obcache_vllm.evidence.eval.command import csv_list  # noqa: E402
from obcache_vllm.evidence.eval.report import paired_difference  # noqa: E402

TOLERANCE = 0.02


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", type=csv_list(str), default=["niah_single"])
    ap.add_argument("--lengths", type=csv_list(int), default=[1024])
    ap.add_argument("--budgets", type=csv_list(float), default=[0.1, 0.2])
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--samples", type=int, default=40)
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "kvpress-parity")
    ap.add_argument("--report-only", action="store_true")
    return ap.parse_args(argv)


def _common(args) -> list[str]:
    return ["--tasks", ",".join(args.tasks), "--lengths", ",".join(map(str, args.lengths)),
            "--pipelines", "snapkv", "--scorers", "attn", "--windows", str(args.window),
            "--budgets", ",".join(map(str, args.budgets)), "--settings", "query_aware",
            "--samples", str(args.samples), "--no-report"]  # fmt: skip


def runs(args) -> list[list[str]]:
    cli = [sys.executable, "-m", "obcache_vllm.cli", "eval"]
    rule_dir = args.out / "obcache-rule"
    return [
        cli + ["run", "--results-dir", str(args.out), *_common(args)],
        cli + ["kvpress", "--results-dir", str(args.out), *_common(args)],
        cli + ["kvpress", "--rule", "obcache", "--results-dir", str(rule_dir), "--no-full",
               *_common(args)],
    ]  # fmt: skip


def _by_cell(path: Path, engine: str) -> dict[tuple, dict]:
    out = {}
    for record in load_results(path).values():
        c = Cell(**record["cell"])
        if c.engine == engine and c.pipeline == "snapkv":
            out[(c.task, c.length, c.budget, c.window, c.samples, c.seed)] = record
    return out


def _acc(record: dict) -> str:
    return f"{record['accuracy']:.2f}"


def _diff(base: dict, other: dict) -> tuple[str, dict]:
    d = paired_difference(base["scores"], other["scores"])
    return f"{d['difference']:+.2f} [{d['ci95'][0]:+.2f}, {d['ci95'][1]:+.2f}]", d


def report(args, seconds: float | None = None) -> str:
    vllm = _by_cell(args.out / "results.jsonl", "vllm")
    published = _by_cell(args.out / "results.jsonl", "kvpress")
    ours = _by_cell(args.out / "obcache-rule" / "results.jsonl", "kvpress")
    lines = [
        "# obcache-vllm's snapkv against kvpress's SnapKV, same prompts",
        "",
        "Command: `.venv/bin/python scripts/kvpress_parity.py` (see its docstring; "
        f"{time.strftime('%Y-%m-%d')}; SmolLM2-135M-Instruct, fp32, greedy; kvpress 0.5.5 on "
        "HF transformers 5.2 in its own venv, `scripts/kvpress_venv.sh`"
        + (f"; {seconds / 60:.0f} min" if seconds else "") + ").",
        "",
        "Every row: the same samples and the same kept counts in each engine, query-aware "
        f"(the question compressed with the document), snapkv window {args.window}, one "
        "selection per KV head. **vLLM − kvpress (our rule)** differs only in the engine: the "
        f"parity check, passed where its difference is within ±{TOLERANCE:.2f}. "
        "**kvpress (our rule) − kvpress** differs only in the rule.",
        "",
        "| task | length | budget | n | kept (mean) | vLLM (ours) | kvpress, our rule | "
        "kvpress SnapKV as published | vLLM − kvpress (our rule) [95 %] | parity | "
        "our rule − published rule, both kvpress [95 %] |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    checks = []
    for key in sorted(vllm):
        if key not in ours or key not in published:
            continue
        mine, rule, pub = vllm[key], ours[key], published[key]
        engine, d = _diff(rule, mine)
        by_rule, _ = _diff(pub, rule)
        ok = abs(d["difference"]) <= TOLERANCE
        checks.append(ok)
        task, length, budget = key[:3]
        lines.append(f"| {task} | {length} | {budget:.0%} | {len(mine['scores'])} | "
                     f"{mine['kept_tokens_mean']:.0f} | {_acc(mine)} | {_acc(rule)} | "
                     f"{_acc(pub)} | {engine} | {'yes' if ok else 'no'} | {by_rule} |")
    lines += ["", f"Parity: {sum(checks)} of {len(checks)} rows within ±{TOLERANCE:.2f}.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.time()
    if not args.report_only:
        for cmd in runs(args):
            print("+", " ".join(cmd[1:]), file=sys.stderr)
            # The runs take turns, so the kvpress runner may use every core.
            env = {**os.environ, "KVPRESS_THREADS": os.environ.get("KVPRESS_THREADS", "2")}
            subprocess.run(cmd, check=True, cwd=ROOT, env=env)
    text = report(args, None if args.report_only else time.time() - start)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "PARITY.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
