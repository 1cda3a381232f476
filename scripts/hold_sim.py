"""The held-entry policy's simulator (``make hold-sim``): multi-turn chats at several pool sizes,
each hold policy, on the model-free harness (tests/support/sched_sim/chats.py: vLLM's real
scheduler and block pool, obcache-vllm's real admission, prefix adapter and ``HeldEntries``,
a symbolic model; every harness invariant checked after every step).

It answers what a server run is too slow to sweep: which follow-ups continue their session
under each policy, and how large a pool must be for a load to continue nearly all of them.
Speed is not simulated (a step stands for any forward pass); the server runs
(``python -m loadtest multiturn``) measure it at the sizes this picks.

    .venv/bin/python scripts/hold_sim.py --out results/hold-sim
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

# policy -> (victims, OBCACHE_ENTRY_POOL_SHARE_MAX); "before" is the release before
# reuse-ranked holds (least recently used first, the base share only)
POLICIES = {
    "before": ("lru", None),
    "lru-0.75": ("lru", 0.75),
    "reuse-0.25": ("reuse", None),
    "reuse-0.75": ("reuse", 0.75),
    "reuse-1.0": ("reuse", 1.0),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pools", type=int, nargs="+", default=[96, 112, 128, 144, 160, 192])
    ap.add_argument("--shapes", nargs="+", default=["vllm", "light", "vllm-light-turns",
                                                     "vllm-light-doc", "vllm-light-answers"])
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "hold-sim")
    args = ap.parse_args()
    logging.disable(logging.WARNING)  # vLLM's config warnings, once per engine
    from support.sched_sim.chats import ChatLoad, simulate

    rows = []
    started = time.perf_counter()
    for shape in args.shapes:
        for pool in args.pools:
            for policy in args.policies:
                victims, share_max = POLICIES[policy]
                cont = follow = violations = refused = 0
                held_max = 0
                for seed in args.seeds:
                    load = ChatLoad(pool_blocks=pool, victims=victims, share_max=share_max,
                                    shape=shape, seed=seed)  # fmt: skip
                    r = simulate(load)
                    cont, follow = cont + r.continued, follow + r.follow_ups
                    violations += r.violations
                    refused += r.refused
                    held_max = max(held_max, max(r.held_blocks, default=0))
                rows.append({"shape": shape, "pool_blocks": pool, "policy": policy,
                             "victims": victims, "share_max": share_max, "seeds": args.seeds,
                             "continued": cont, "follow_ups": follow,
                             "share": round(cont / follow, 3) if follow else None,
                             "refused": refused, "held_blocks_max": held_max,
                             "violations": violations, "load": asdict(load)})  # fmt: skip
                print(f"{shape} {pool} {policy}: {cont}/{follow} violations {violations}",
                      flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sim.json").write_text(json.dumps(rows, indent=1) + "\n")
    (args.out / "sim.md").write_text(markdown(rows, args.policies))
    print(f"{time.perf_counter() - started:.0f} s; wrote {args.out / 'sim.md'}")
    return 1 if any(r["violations"] for r in rows) else 0


def markdown(rows: list[dict], policies: list[str]) -> str:
    out = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        out += [f"Shape `{shape}`: follow-ups that continued their session (all seeds)", "",
                "| pool (blocks) | " + " | ".join(policies) + " |",
                "|---|" + "---|" * len(policies)]  # fmt: skip
        for pool in dict.fromkeys(r["pool_blocks"] for r in rows if r["shape"] == shape):
            cells = []
            for policy in policies:
                r = next(r for r in rows if (r["shape"], r["pool_blocks"], r["policy"])
                         == (shape, pool, policy))  # fmt: skip
                cells.append(f"{r['continued']} / {r['follow_ups']} ({r['share']:.0%})")
            out.append(f"| {pool} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
