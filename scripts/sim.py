"""The long run of the model-free scheduler harness (``make sim``): seeded random sequences.

Each case is drawn from a seed (tests/support/sched_sim/gen.py ``case_for``) and run on a
fresh simulated engine with every invariant checked after every step and at the end
(tests/support/sched_sim/checks.py). One case in five is also run paired: a sequence without
budgets against vLLM's own ``Scheduler`` (the same decisions at every step, the same tokens),
and one with ``kv_when: "pressure"`` budgets against the same traffic unbudgeted (the same
decisions up to the first compression under pressure). A case that breaks an invariant is
shrunk (``shrink.shrink_finding``) and printed as a ``Case(...)`` to paste into
tests/vllm/test_scheduler_sim.py. The report (counts of cases, steps and violations by kind,
the shrunk cases) goes to ``--out``; the exit status is non-zero on any violation.

    python scripts/sim.py --cases 20000 --minutes 60 --seed 1 --out results/sim
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import time
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=20000)
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=1, help="seed of the first case")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "sim")
    parser.add_argument("--shrink", type=int, default=3, help="violating cases shrunk, at most")
    args = parser.parse_args()

    logging.disable(logging.WARNING)  # contained faults are violations here, counted below
    from support.sched_sim.gen import case_for
    from support.sched_sim.ops import run
    from support.sched_sim.shrink import findings, kind_of, pasteable, shrink_finding

    started = time.monotonic()
    deadline = started + args.minutes * 60
    counts: Counter = Counter()
    kinds: Counter = Counter()
    shrunk: list[dict] = []
    seed = args.seed
    while counts["cases"] < args.cases and time.monotonic() < deadline:
        case, mode = case_for(seed)
        if mode == "all":  # counted from its own run (a paired mode runs two engines)
            sim = run(case)
            found = [str(v) for v in sim.violations]
            counts["steps"] += sim.steps
            counts["ops"] += len(case.ops)
        else:
            found = findings(case, mode)
            counts["paired_" + mode] += 1
        counts["cases"] += 1
        for text in found:
            kinds[kind_of(text)] += 1
        if found and len(shrunk) < args.shrink:
            kind = kind_of(found[0])
            small = shrink_finding(case, mode, kind)
            shrunk.append({"seed": seed, "mode": mode, "kind": kind, "first": found[0],
                           "case": pasteable(small)})  # fmt: skip
            print(f"seed {seed} ({mode}): {found[0]}\n{shrunk[-1]['case']}", flush=True)
        seed += 1
        if counts["cases"] % 1000 == 0:
            print(f"{counts['cases']} cases, {counts['steps']} steps, "
                  f"{sum(kinds.values())} violations, {time.monotonic() - started:.0f} s",
                  flush=True)  # fmt: skip
    report = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": _commit(),
        "command": " ".join(["python", "scripts/sim.py", *sys.argv[1:]]),
        "first_seed": args.seed,
        "last_seed": seed - 1,
        "cases": counts["cases"],
        "steps": counts["steps"],
        "ops": counts["ops"],
        "paired_stock": counts["paired_stock"],
        "paired_pressure": counts["paired_pressure"],
        "seconds": round(time.monotonic() - started, 1),
        "violations": dict(kinds),
        "shrunk": shrunk,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sim.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "shrunk"}, indent=1))
    return 1 if kinds else 0


if __name__ == "__main__":
    sys.exit(main())
