"""The cells of an evaluation grid from the command line's lists (stdlib only)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from obcache_vllm.evidence.eval.cells import FULL, Cell, ranks, takes_window

# How kvpress 0.5.5 selects, per press: SnapKV and ObservedAttention rank per KV head, TOVA
# averages the last query's attention over all heads (one ranking per layer).
KVPRESS_PER_HEAD = {"snapkv": True, "h2o": True, "tova": False}

PIPELINES = ("snapkv", "h2o", "tova", "streaming")
SCORERS = ("attn", "value_norm", "obcache_value", "obcache_key", "obcache_joint", "dropkv",
           "random")  # the closest published rival (DropKV) and the floor beside the scores
BUDGETS = (0.1, 0.2, 0.3, 0.5)
EVICTION_SETTINGS = ("query_aware", "query_agnostic")


def grid(
    *,
    tasks: Sequence[str],
    lengths: Sequence[int],
    samples: int,
    seed: int,
    chat: bool,
    pipelines: Sequence[str] = PIPELINES,
    scorers: Sequence[str] = SCORERS,
    budgets: Sequence[float] = BUDGETS,
    settings: Sequence[str] = EVICTION_SETTINGS,
    windows: Sequence[int] = (64,),
    per_heads: Sequence[bool] = (True,),
    prefill_evicts: Sequence[bool] = (False,),
    full: bool = True,
    engine: str = "vllm",
) -> list[Cell]:
    """Full-cache cells first (if ``full``), then every eviction cell of the product.

    ``streaming`` has no score, so it gets one cell per budget and setting (scorer ``-``), and
    ``windows`` only multiply ``snapkv`` cells; ``prefill_evicts`` multiply every eviction
    cell. ``per_heads`` multiply ranked cells; kvpress cells ignore it and get the selection
    their press implements (:data:`KVPRESS_PER_HEAD`).
    """
    common = dict(samples=samples, seed=seed, chat=chat, engine=engine)
    cells = []
    for task, length in itertools.product(tasks, lengths):
        if full:
            cells.append(Cell(task, length, FULL, FULL, "-", 1.0, **common))
        for setting, budget, pipeline in itertools.product(settings, budgets, pipelines):
            for pe in prefill_evicts:
                if not ranks(pipeline):
                    cells.append(Cell(task, length, setting, pipeline, "-", budget,
                                      prefill_evict=pe, **common))  # fmt: skip
                    continue
                selections = (KVPRESS_PER_HEAD[pipeline],) if engine == "kvpress" else per_heads
                for scorer, per_head in itertools.product(scorers, selections):
                    for w in windows if takes_window(pipeline) else (0,):
                        cells.append(Cell(task, length, setting, pipeline, scorer, budget,
                                          window=w, per_head=per_head, prefill_evict=pe,
                                          **common))  # fmt: skip
    return cells
