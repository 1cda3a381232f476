"""One tensor-parallel rank of test_tensor_parallel.py (run as a script, gloo on CPU).

Usage: ``python tp_ranks.py RANK WORLD STORE_FILE OUT_JSON``. The rank holds KV heads
``[RANK*H/WORLD, (RANK+1)*H/WORLD)`` of the scores the test generates (same seed), selects with
one ranking per layer summed over the group, and agrees on row outcomes with the other ranks;
it writes what it kept and what it agreed to OUT_JSON.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, __file__.rsplit("/tests/", 1)[0])

from obcache_vllm.eviction.step import RowOutcome, agree_across_ranks  # noqa: E402
from obcache_vllm.scoring import make_pipeline  # noqa: E402

HEADS, TOKENS, KEEP, RECENT, SINKS, LAYERS = 4, 96, 40, 8, 2, 5


def layer_scores(seed: int) -> torch.Tensor:
    """Integer-valued fp32 scores [HEADS, TOKENS]: sums are exact in any order."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1 << 20, (HEADS, TOKENS), generator=gen).float()


class _Row:  # the part of RowPlan agree_across_ranks reads
    def __init__(self, compacted: int, failure=None) -> None:
        self.outcome = RowOutcome(compacted_layers=compacted, failure=failure)


# Per rank: (compacted layers, local failure) of three rows.
OUTCOMES = {
    0: [(LAYERS, None), (LAYERS, None), (0, ("score", "KeyError", "x"))],
    1: [(LAYERS, None), (3, ("compact", "injected", "y")), (0, None)],
}


def main() -> None:
    rank, world, store, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    per_rank = HEADS // world
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    calls = []

    def all_reduce(t: torch.Tensor) -> torch.Tensor:
        calls.append(tuple(t.shape))
        dist.all_reduce(t)
        return t

    kept = {}
    for name in ("tova", "snapkv", "h2o"):
        for per_head in (False, True):
            pipeline = make_pipeline(name, per_head=per_head)
            local = layer_scores(7)[mine]  # [HEADS / world, TOKENS]
            keep = pipeline.select(local, KEEP, recent=RECENT, sinks=SINKS, reduce=all_reduce)
            kept[f"{name}/{per_head}"] = keep.tolist()
    rows = [_Row(*o) for o in OUTCOMES[rank]]
    agree_across_ranks(tuple(rows), LAYERS, dist.group.WORLD)
    agreed = [[r.outcome.compacted_layers, r.outcome.failure] for r in rows]
    with open(out, "w") as f:
        json.dump({"kept": kept, "calls": calls, "agreed": agreed}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
