"""Tensor parallelism on CPU: 2 ranks (gloo), each holding half of a layer's KV heads.

* Per-head selection is rank-local and needs no communication: each rank keeps the same COUNT
  per head (so one block table stays valid) and exactly what one process holding all heads
  keeps for those heads.
* One ranking per layer (``kv_per_head=false``): the scores summed over the rank's heads are
  all-reduced over the group, so every head on every rank keeps what a single process summing
  ALL heads keeps.
* Row outcomes are agreed before the commit: a fault on one rank fails the row everywhere, and
  a row some rank compacted further than another is torn everywhere.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import tp_ranks  # noqa: E402

from obcache_vllm.scoring import make_pipeline  # noqa: E402


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("tp")
    store = tmp / "store"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    script = str(HERE / "tp_ranks.py")
    procs = [
        subprocess.Popen(
            [sys.executable, script, str(r), "2", str(store), str(tmp / f"{r}.json")],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for r in range(2)
    ]  # fmt: skip
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-3000:]
    return [json.loads((tmp / f"{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("name", ["tova", "snapkv", "h2o"])
def test_shared_ranking_across_ranks_equals_one_process(ranks, name):
    full = make_pipeline(name, per_head=False).select(
        tp_ranks.layer_scores(7), tp_ranks.KEEP, recent=tp_ranks.RECENT, sinks=tp_ranks.SINKS
    )  # [HEADS, K]: one process, all heads
    assert (full == full[0]).all()  # one ranking: every head keeps the same tokens
    got = torch.tensor([ranks[0]["kept"][f"{name}/False"], ranks[1]["kept"][f"{name}/False"]])
    assert torch.equal(got.view_as(full), full)


@pytest.mark.parametrize("name", ["tova", "snapkv", "h2o"])
def test_per_head_selection_is_rank_local(ranks, name):
    full = make_pipeline(name, per_head=True).select(
        tp_ranks.layer_scores(7), tp_ranks.KEEP, recent=tp_ranks.RECENT, sinks=tp_ranks.SINKS
    )
    got = torch.tensor([ranks[0]["kept"][f"{name}/True"], ranks[1]["kept"][f"{name}/True"]])
    assert torch.equal(got.view_as(full), full)  # same count per head, same tokens per head
    assert len({len(row) for r in ranks for row in r["kept"][f"{name}/True"]}) == 1


def test_only_shared_rankings_communicate(ranks):
    # 3 pipelines x (shared, per-head): one all-reduce of [1, T] per shared ranking, none else.
    for r in ranks:
        assert r["calls"] == [[1, tp_ranks.TOKENS]] * 3


def test_row_outcomes_agree_across_ranks(ranks):
    layers = tp_ranks.LAYERS
    (a0, b0, c0), (a1, b1, c1) = ranks[0]["agreed"], ranks[1]["agreed"]
    assert a0 == a1 == [layers, None]  # compacted everywhere: applied
    # Rank 1 failed after 3 layers, rank 0 wrote all 5: torn on both, failed on both.
    assert b0[0] == b1[0] == 3 and b0[1][1] == "tp_peer" and b1[1][1] == "injected"
    # Rank 0 failed before writing; rank 1 wrote nothing either: uncompressed, failed on both.
    assert c0[0] == c1[0] == 0 and c0[1][1] == "KeyError" and c1[1][1] == "tp_peer"
