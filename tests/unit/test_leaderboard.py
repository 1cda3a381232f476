"""scripts/leaderboard.py's own logic: the arms it sends and the table it makes of lm_eval_grid's
results (the grid's run itself: tests/server/test_lm_eval.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import leaderboard as lb  # noqa: E402

from obcache_vllm.admission import parse_kv_options  # noqa: E402

pytestmark = pytest.mark.unit


def test_every_host_with_every_scorer_then_the_floors_at_each_ratio():
    arms = lb.leaderboard_arms(["attn", "obcache_key"], removed=(0.25, 0.75), tail=96)
    assert len(arms) == (4 * 2 + 2) * 2
    assert arms["snapkv/obcache_key/0.25"] == {
        "kv_pipeline": "snapkv", "kv_per_head": True, "kv_window": 32,
        "kv_scorer": "obcache_key", "kv_budget": 0.75, "kv_compress_at": -96,
    }  # fmt: skip
    assert arms["tova/attn/0.75"]["kv_budget"] == 0.25
    assert arms["tova/attn/0.75"]["kv_per_head"] is False
    assert arms["snapkv/random/0.75"]["kv_scorer"] == "random"
    assert arms["streaming/0.25"] == {"kv_pipeline": "streaming", "kv_budget": 0.75,
                                      "kv_compress_at": -96}  # fmt: skip
    # Every arm is a request the server accepts (the options' own parser, as the server's).
    for name, fields in arms.items():
        assert parse_kv_options(fields, 2048).budget is not None, name


def _row(arm, task, accuracy, diff=None, kept=None):
    row = {"arm": arm, "task": task, "length": 2048, "n": 10, "accuracy": accuracy,
           "kept": kept}  # fmt: skip
    if diff is not None:
        row["diff"] = diff
    return row


def test_the_table_is_the_mean_over_tasks_per_row_and_ratio():
    results = {
        "model": "m", "lm_eval_version": "0.4.13", "date": "d", "machine": "here",
        "seconds": 120.0, "command": "python scripts/lm_eval_grid.py ...",
        "rows": [
            _row("full", "niah_single_1", 1.0), _row("full", "ruler_fwe", 0.3),
            _row("snapkv/attn/0.5", "niah_single_1", 0.8, -0.2, 0.55),
            _row("snapkv/attn/0.5", "ruler_fwe", 0.2, -0.1, 0.55),
            _row("snapkv/attn/0.25", "niah_single_1", 1.0, 0.0, 0.8),
            _row("snapkv/attn/0.25", "ruler_fwe", 0.3, 0.0, 0.8),
            _row("streaming/0.5", "niah_single_1", 0.0, -1.0, 0.55),
            _row("streaming/0.5", "ruler_fwe", 0.1, -0.2, 0.55),
        ],
    }  # fmt: skip
    table = lb.table(results)
    assert table["full cache"][0.0]["score"] == pytest.approx(65.0)
    assert table["snapkv/attn"][0.5]["score"] == pytest.approx(50.0)
    assert table["snapkv/attn"][0.5]["diff"] == pytest.approx(-15.0)
    assert table["streaming"][0.5]["score"] == pytest.approx(5.0)
    text = lb.render(results, "results/leaderboard")
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("| host / scorer"))
    assert header == "| host / scorer | 25% removed | 50% removed |"
    assert "| full cache | 65.0 (every column) | |" in lines
    assert "| snapkv/attn | 65.0 (Δ +0.0, kept 0.80) | 50.0 (Δ -15.0, kept 0.55) |" in lines
    assert "| streaming |  | 5.0 (Δ -60.0, kept 0.55) |" in lines
