"""The long concurrent stress of KV reuse on the real engine (``make stress``).

Runs seeded cases of tests/support/stress.py (requests in flight together over shared
documents; see that module for what is drawn and what must hold) on one in-process engine
with the test suite's settings, and writes a report: cases, requests, what was exercised
(adoptions, entries, preemptions, aborts, resets, oracle checks) and every problem found,
each with the command that replays its case.

    .venv/bin/python scripts/stress.py --cases 2000 --out results/stress
    OBCACHE_STRESS_SEED=7 OBCACHE_STRESS_CASES=12:13 .venv/bin/python scripts/stress.py
    # two processes, one per core, then one report:
    OBCACHE_STRESS_CASES=0:1000 ... --out /tmp/a;  OBCACHE_STRESS_CASES=1000:2000 ... --out /tmp/b
    .venv/bin/python scripts/stress.py --merge /tmp/a /tmp/b --out results/stress

Bounded: it stops after ``--cases`` cases or ``--minutes`` minutes, whichever comes first.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

# Before vLLM is imported: the engine in this process, the oracle on, one core.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("OBCACHE_VLLM_VERIFY", "1")
os.environ.setdefault("OBCACHE_VLLM_RECORD_KEEP", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")


PROFILES = {
    "suite": {"engine": {}, "corpus": {}},
    "small": {
        "engine": {"num_gpu_blocks_override": 32,
                   "max_num_batched_tokens": 128, "max_model_len": 1024},
        "corpus": {"sizes": ((21, 243), (22, 173), (23, 97))},
    },
}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=2000)
    parser.add_argument("--minutes", type=float, default=240.0)
    parser.add_argument("--seed", default=os.environ.get("OBCACHE_STRESS_SEED", "long"))
    parser.add_argument("--out", type=Path, default=None, help="report folder")
    parser.add_argument(
        "--profile", choices=sorted(PROFILES), default="small",
        help="suite: the suite's engine and documents (96 blocks of 32, ~700-token documents); "
        "small: a 32-block pool, 128-token steps and ~100-250-token "
        "documents (the same mixes, about 5x cheaper per case, at the pool's limit more often)",
    )  # fmt: skip
    parser.add_argument("--merge", type=Path, nargs="+", default=None,
                        help="report folders of runs over disjoint case ranges: one report")
    args = parser.parse_args()
    if args.merge:
        return write(merge([json.loads((d / "report.json").read_text()) for d in args.merge]),
                     args.out)  # fmt: skip
    first, last = 0, args.cases
    if os.environ.get("OBCACHE_STRESS_CASES"):  # "a:b": replay cases a..b-1
        first, last = (int(x) for x in os.environ["OBCACHE_STRESS_CASES"].split(":"))

    from obcache_vllm.cpu_binding import bind_in_process

    # An in-process engine ignores VLLM_CPU_OMP_THREADS_BIND (obcache_vllm/cpu_binding.py):
    # applied here, so the report's "engine on one core" is what ran.
    bind_in_process()

    from support.engine import ENGINE_KWARGS, POOL_BLOCKS, Internals
    from support.stress import Stress, draw_case, replay
    from transformers import AutoTokenizer
    from vllm import LLM

    from obcache_vllm.model import default_model_path

    sys.path.insert(0, str(ROOT / "tests" / "engine"))
    from test_stress import corpus  # the suite's documents and questions

    # The code under test is what was checked out when the run started.
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()  # fmt: skip
    profile = PROFILES[args.profile]
    engine_kwargs = {**ENGINE_KWARGS, **profile["engine"]}
    pool_blocks = engine_kwargs.get("num_gpu_blocks_override", POOL_BLOCKS)
    path = default_model_path()
    llm = LLM(model=str(path), **engine_kwargs)
    engine = Internals(llm)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    docs, questions = corpus(tokenizer, **profile["corpus"])
    stress = Stress(engine, pool_blocks)
    totals: Counter = Counter()
    problems = []
    started = time.monotonic()
    done = 0
    for index in range(first, last):
        if time.monotonic() - started > args.minutes * 60:
            break
        case = draw_case(args.seed, index, docs, questions)
        outcome = stress.check(case)
        totals.update(outcome.stats)
        done += 1
        if outcome.problems:
            problems.append({"case": case.seed, "requests": case.describe(),
                             "problems": outcome.problems, "replay": replay(args.seed, index)})
            print(f"case {case.seed}: PROBLEM {outcome.problems}", flush=True)
        if done % 25 == 0:
            print(f"{done} cases, {time.monotonic() - started:.0f} s, {dict(totals)}", flush=True)
    seconds = time.monotonic() - started
    report = {
        "seed": args.seed,
        "cases": done,
        "first_case": first,
        "seconds": round(seconds, 1),
        "problems": problems,
        "totals": dict(totals),
        "oracle_checks": engine.runner.obcache.oracle.checks,
        "profile": args.profile,
        "engine": engine_kwargs,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, engine on one core",
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit,
        "command": " ".join(["python", "scripts/stress.py", *sys.argv[1:]]),
    }
    return write(report, args.out)


def write(report: dict, out: Path | None) -> int:
    print(json.dumps({k: v for k, v in report.items() if k != "problems"}, indent=1))
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
        (out / "report.md").write_text(render(report))
    return 1 if report["problems"] else 0


def merge(reports: list[dict]) -> dict:
    """One report of runs over disjoint case ranges of one seed (in parallel processes)."""
    first = reports[0]
    assert len({(r["seed"], r["profile"]) for r in reports}) == 1, "not one seed and profile"
    totals: Counter = Counter()
    for r in reports:
        totals.update(r["totals"])
    return {
        **first,
        "cases": sum(r["cases"] for r in reports),
        "first_case": min(r["first_case"] for r in reports),
        "seconds": max(r["seconds"] for r in reports),
        "problems": [p for r in reports for p in r["problems"]],
        "totals": dict(totals),
        "oracle_checks": sum(r["oracle_checks"] for r in reports),
        "command": " + ".join(f"{r['command']} [cases {r['first_case']}-"
                              f"{r['first_case'] + r['cases'] - 1}]" for r in reports),
        "commit": ", ".join(dict.fromkeys(r["commit"] for r in reports)),
        "machine": f"{first['machine']}; {len(reports)} processes in parallel",
    }


def render(report: dict) -> str:
    t = report["totals"]
    lines = [
        "# Concurrent reuse stress",
        "",
        f"`{report['command']}` on {report['date']}, commit {report['commit']} "
        f"({report['machine']}; profile `{report['profile']}`: {report['engine']}; seed "
        f"`{report['seed']}`, {report['seconds'] / 60:.0f} min).",
        "",
        "| what | count |",
        "|---|---|",
        f"| cases (each one drawn interleaving of arrivals, aborts, resets) | {report['cases']} |",
        f"| requests | {t.get('requests', 0)} |",
        f"| requests compared with the same request alone | {t.get('compared', 0)} |",
        f"| kv_compress_at adoptions / entries made | {t.get('compress_at_hit', 0)} / "
        f"{t.get('compress_at_created', 0)} |",
        f"| session continuations / entries made | {t.get('session_hit', 0)} / "
        f"{t.get('session_created', 0)} |",
        f"| held entries given up (released) | "
        f"{t.get('compress_at_released', 0) + t.get('session_released', 0)} |",
        f"| preemptions | {t.get('preemptions', 0)} |",
        f"| aborts | {t.get('aborted', 0)} |",
        f"| resets of the prefix cache | {t.get('resets', 0)} |",
        f"| KV oracle comparisons (entries and adoptions; copies are checked every step) | "
        f"{report['oracle_checks']} |",
        f"| cases with a problem (oracle mismatch, fault, leak, different tokens) | "
        f"{len(report['problems'])} |",
        "",
    ]
    for problem in report["problems"]:
        lines += [f"- case {problem['case']}: {problem['problems']} ({problem['replay']})"]
    if report.get("notes"):
        lines += ["", *report["notes"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
