"""The accuracy evidence committed in results/eval, in stages (most informative first).

    PYTHONPATH=. .venv/bin/python scripts/eval_evidence.py [--stages selection,scorers,...]
        [--lock /tmp/obcache-core1.lock]

Every stage is a list of grid cells; cells already in results/eval/results.jsonl are skipped, so
an interrupted run resumes, and two runs with different ``--stages`` can share the file (each
appends whole lines). The report (RESULTS.md, results.json, PNGs) is rewritten at the end. The
full grid of the issue is `obcache-vllm eval run` with its defaults (README, "Evidence:
accuracy"); it is days of CPU on a 2-core machine, so this is the subset that fits a session,
chosen so that its comparisons are paired (same samples) and resolved by the sample counts.

Stages (niah_single / niah_multikey, 512 nominal tokens, ~600 with the chat template):
  calibration  full cache of the four tasks, n = 12 (multivalue and vt are dropped from eviction
               cells: full-cache accuracy 0.52 and 0.32)
  selection    20 % query-aware, n = 12: snapkv windows 1/16/64 x attn/obcache_key x per-head /
               shared ranking, tova and h2o per-head / shared, streaming -- picks the selection
               the other stages use
  scorers      snapkv, the selected window and ranking, x the five scorers x 10/20/30 % x both
               settings, n = 12
  pipelines    tova and h2o (selected ranking) x the five scorers, streaming; 20 %, both settings
  multikey     niah_multikey, snapkv selected, attn / obcache_key, 20 % and 50 %, both settings
  kvpress      the reference on the selection stage's kvpress-comparable cells (snapkv w1 and
               w64 per head, tova shared, h2o = ObservedAttention per head, streaming), 20 %
  floor_rival  the floor (``random``) and the closest rival (kvpress's DropKV score, ``dropkv``)
               in the scorers and multikey stages' cells (snapkv, the selected window and
               ranking; niah_single 10/20/30 %, niah_multikey 20/50 %, both settings), n = 12
"""

from __future__ import annotations

import argparse
from pathlib import Path

from obcache_vllm.evidence.eval.grid import SCORERS, grid

RESULTS = Path("results/eval")
COMMON = dict(lengths=[512], seed=0, chat=True, samples=12)
ALL_TASKS = ["niah_single", "niah_multikey", "niah_multivalue", "vt"]
# Chosen from the selection stage (docs/evidence/accuracy.md): the 1-query window kept the
# needle best at 20 %, and one ranking per layer did not lose to per-head selection anywhere.
WINDOW, PER_HEAD = 1, False


def _cells(**kw):
    return grid(**{**COMMON, "full": False, **kw})


def stages() -> dict[str, list]:
    single = dict(tasks=["niah_single"])
    aware = dict(settings=["query_aware"], budgets=[0.2])
    both = ("query_aware", "query_agnostic")
    return {
        "calibration": grid(tasks=ALL_TASKS, budgets=[], settings=[], **COMMON),
        "selection": [
            *_cells(**single, **aware, pipelines=["snapkv"], windows=[1, 16, 64],
                    scorers=["attn", "obcache_key"], per_heads=[True, False]),
            *_cells(**single, **aware, pipelines=["tova"], scorers=["attn", "obcache_key"],
                    per_heads=[True, False]),
            *_cells(**single, **aware, pipelines=["h2o"], scorers=["attn"],
                    per_heads=[True, False]),
            *_cells(**single, **aware, pipelines=["streaming"]),
        ],
        "scorers": _cells(**single, settings=both, budgets=[0.1, 0.2, 0.3], pipelines=["snapkv"],
                          windows=[WINDOW], per_heads=[PER_HEAD], scorers=SCORERS),
        "pipelines": _cells(**single, settings=both, budgets=[0.2],
                            pipelines=["tova", "h2o", "streaming"], per_heads=[PER_HEAD]),
        "multikey": _cells(tasks=["niah_multikey"], settings=both, budgets=[0.2, 0.5],
                           pipelines=["snapkv"], windows=[WINDOW], per_heads=[PER_HEAD],
                           scorers=["attn", "obcache_key"]),
        "floor_rival": [
            *_cells(**single, settings=both, budgets=[0.1, 0.2, 0.3], pipelines=["snapkv"],
                    windows=[WINDOW], per_heads=[PER_HEAD], scorers=["random", "dropkv"]),
            *_cells(tasks=["niah_multikey"], settings=both, budgets=[0.2, 0.5],
                    pipelines=["snapkv"], windows=[WINDOW], per_heads=[PER_HEAD],
                    scorers=["random", "dropkv"]),
        ],
        "kvpress": _cells(**single, **aware, pipelines=["snapkv", "tova", "h2o", "streaming"],
                          scorers=["attn"], windows=[1, 64], engine="kvpress"),
    }  # fmt: skip


if __name__ == "__main__":
    from obcache_vllm.evidence.eval.harness import Harness
    from obcache_vllm.evidence.eval.kvpress_bridge import run_kvpress
    from obcache_vllm.evidence.eval.report import write_report

    plan = stages()
    parser = argparse.ArgumentParser()
    parser.add_argument("--stages", default=",".join(plan), help="comma-separated, in order")
    parser.add_argument("--lock", default=None, help="flock this file while the engine works")
    args = parser.parse_args()
    results = RESULTS / "results.jsonl"
    harness = Harness(results, lock=args.lock, max_batch=64, max_model_len=2048)
    try:
        for name in args.stages.split(","):
            cells = plan[name]
            print(f"stage {name}: {len(cells)} cells, {len(harness.pending(cells))} to compute",
                  flush=True)  # fmt: skip
            if name == "kvpress":
                run_kvpress(cells, results, lock=args.lock)
            else:
                harness.run(cells)
    finally:
        harness.close()
    for path in write_report(RESULTS):
        print(path)
