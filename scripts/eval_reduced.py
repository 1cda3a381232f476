"""The reduced accuracy grid committed in results/eval (what fit in one CPU-starved session).

    PYTHONPATH=. .venv/bin/python scripts/eval_reduced.py [--lock /tmp/obcache-core1.lock]

One engine for all cells (resumable: cells already in results/eval/results.jsonl are skipped),
then the report. The full grid is `obcache-vllm eval run` with its defaults (README, "Evidence:
accuracy").
"""

from __future__ import annotations

import argparse
from pathlib import Path

from obcache_vllm.eval.grid import grid
from obcache_vllm.eval.harness import Harness
from obcache_vllm.eval.report import write_report

RESULTS = Path("results/eval")
# Calibration (n=8, 512 tokens, 50 %): snapkv with a 1-query window kept the needle, 16 and 64
# query windows lost it (see README); so snapkv runs with window 1 here.
COMMON = dict(lengths=[512], seed=0, chat=True, windows=[1])
METHODS = [
    dict(pipelines=["snapkv"], scorers=["attn", "value_norm", "obcache_value", "obcache_key"]),
    dict(pipelines=["tova"], scorers=["attn", "obcache_key"]),
    dict(pipelines=["h2o"], scorers=["attn"]),
    dict(pipelines=["streaming"], scorers=["-"]),
]


def cells():
    out = grid(tasks=["niah_single", "niah_multikey", "niah_multivalue", "vt"], samples=12,
               budgets=[], settings=[], **COMMON)  # full cache only: the four tasks calibrated
    # Most informative first (the run is resumable; what finished is reported).
    for task, budget, setting in (
        ("niah_single", 0.5, "query_aware"),
        ("niah_single", 0.5, "query_agnostic"),
        ("niah_single", 0.2, "query_aware"),
        ("niah_multikey", 0.5, "query_aware"),
    ):
        for m in METHODS:
            out += grid(tasks=[task], samples=12, budgets=[budget], settings=[setting],
                        full=False, **COMMON, **m)  # fmt: skip
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--lock", default=None)
    args = parser.parse_args()
    harness = Harness(RESULTS / "results.jsonl", lock=args.lock, max_batch=64, max_model_len=2048)
    try:
        harness.run(cells())
    finally:
        harness.close()
    for path in write_report(RESULTS):
        print(path)
