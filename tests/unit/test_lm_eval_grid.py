"""scripts/lm_eval_grid.py's own logic: the arms it sends, how it reads lm-eval's samples, the
paired difference and the report (the run itself: tests/server/test_lm_eval.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import lm_eval_grid as grid  # noqa: E402

pytestmark = pytest.mark.unit


def test_arms_are_the_full_cache_then_every_combination():
    arms = grid.arms(["", "snapkv"], ["obcache_key"], [0.2], ["aware", "agnostic"], tail=96)
    assert [a.name for a in arms] == [
        "full", "obcache_key/0.2/aware", "obcache_key/0.2/agnostic",
        "snapkv/obcache_key/0.2/aware", "snapkv/obcache_key/0.2/agnostic",
    ]  # fmt: skip
    full, aware, agnostic = arms[:3]
    assert full.fields == {"kv_budget": None} and full.is_full  # stock whatever the default
    assert aware.fields == {"kv_budget": 0.2, "kv_scorer": "obcache_key"}
    assert agnostic.fields["kv_compress_at"] == -96 and not agnostic.is_full
    assert "kv_pipeline" not in aware.fields and arms[3].fields["kv_pipeline"] == "snapkv"
    with pytest.raises(ValueError, match="setting"):
        grid.arms([""], ["attn"], [0.2], ["sideways"], tail=96)


def test_the_command_carries_the_arm_as_gen_kwargs():
    arm = grid.Arm("x", {"kv_budget": 0.2, "kv_compress_at": -96})
    cmd = grid.lm_eval_command("lm_eval", "http://h:1", "m", "/tok", arm, ["niah_single_1"],
                               [1024], 50, 8, Path("out"))  # fmt: skip
    assert json.loads(cmd[cmd.index("--gen_kwargs") + 1]) == arm.fields
    assert json.loads(cmd[cmd.index("--metadata") + 1]) == {"max_seq_lengths": [1024]}
    assert "base_url=http://h:1/v1/completions" in cmd[cmd.index("--model_args") + 1]
    # a slow arm's requests wait behind each other: lm-eval's 300-s default timed one out
    assert f"timeout={grid.REQUEST_TIMEOUT_S}" in cmd[cmd.index("--model_args") + 1]


def _samples(path: Path, task: str, scores: dict[int, float], length: int = 1024) -> None:
    path.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"doc_id": d, "4096": -1.0, str(length): s}) for d, s in scores.items()]
    (path / f"samples_{task}_2026-12-02T16-04-03.661669.jsonl").write_text("\n".join(lines))


def test_samples_are_read_per_task_and_length_and_paired_by_document(tmp_path):
    _samples(tmp_path / "full", "niah_single_1", {0: 1.0, 1: 1.0, 2: 0.0, 3: 1.0})
    _samples(tmp_path / "arm", "niah_single_1", {0: 1.0, 1: 0.0, 2: 0.0, 3: 0.0})
    _samples(tmp_path / "arm", "ruler_vt", {0: 0.2, 1: 0.4})
    full = grid.read_samples(tmp_path / "full", [1024])
    arm = grid.read_samples(tmp_path / "arm", [1024])
    assert full == {"niah_single_1": {1024: {0: 1.0, 1: 1.0, 2: 0.0, 3: 1.0}}}
    assert arm["ruler_vt"][1024] == {0: 0.2, 1: 0.4}
    mean, lo, hi = grid.paired_difference(arm["niah_single_1"][1024], full["niah_single_1"][1024])
    assert mean == -0.5 and lo <= mean <= hi <= 0.0
    runs = {"full": {"scores": full, "kept_ratio": None},
            "a": {"scores": arm, "kept_ratio": 0.25}}  # fmt: skip
    rows = grid.summarize(runs)
    niah = next(r for r in rows if r["arm"] == "a" and r["task"] == "niah_single_1")
    assert (niah["n"], niah["accuracy"], niah["diff"]) == (4, 0.25, -0.5)
    assert "diff" not in next(r for r in rows if r["arm"] == "a" and r["task"] == "ruler_vt")
    md = grid.render({"rows": rows, "arms": ["full", "a"], "lm_eval_version": "0.4.13",
                      "model": "m", "date": "d", "machine": "here", "command": "c",
                      "seconds": 1.0})  # fmt: skip
    assert "| a | 0.25 | 0.25 [" in md and "Δ -0.50" in md and "| full | 1.00 | 0.75 [" in md


def test_each_score_is_paired_with_the_attn_arm_that_differs_only_by_it():
    docs = {1024: {0: 1.0, 1: 0.0, 2: 1.0}}
    runs = {
        "full": {"fields": {"kv_budget": None}, "scores": {"t": {1024: {0: 1, 1: 1, 2: 1}}}},
        "attn/0.2/agnostic": {"fields": {"kv_budget": 0.2, "kv_scorer": "attn",
                                         "kv_compress_at": -96}, "scores": {"t": docs}},
        "attn/0.2/aware": {"fields": {"kv_budget": 0.2, "kv_scorer": "attn"},
                           "scores": {"t": {1024: {0: 0.0, 1: 0.0, 2: 0.0}}}},
        "obcache_key/0.2/agnostic": {"fields": {"kv_budget": 0.2, "kv_scorer": "obcache_key",
                                                "kv_compress_at": -96},
                                     "scores": {"t": {1024: {0: 1.0, 1: 1.0, 2: 1.0}}}},
    }  # fmt: skip
    (pair,) = grid.versus(runs)
    assert (pair["arm"], pair["baseline"]) == ("obcache_key/0.2/agnostic", "attn/0.2/agnostic")
    assert abs(pair["diff"] - 1 / 3) < 1e-9 and pair["low"] >= 0.0


def test_a_later_run_adds_its_arms_paired_with_the_committed_ones(tmp_path):
    """``--add-to``: a later run's arms join a committed lm_eval.json, pair with its full cache
    and its ``attn`` arm, and the report names the later command; a name already there is
    refused before anything runs."""
    committed = {
        "command": "first", "date": "d1", "machine": "m", "model": "M", "lm_eval_version": "v",
        "seconds": 10.0, "arms": ["full", "attn/0.2/aware"],
        "runs": {
            "full": {"fields": {"kv_budget": None}, "kept_ratio": None,
                     "scores": {"t": {"1024": {"0": 1.0, "1": 1.0}}}},
            "attn/0.2/aware": {"fields": {"kv_budget": 0.2, "kv_scorer": "attn"},
                               "kept_ratio": 0.2, "scores": {"t": {"1024": {"0": 1.0, "1": 0.0}}}},
        },
    }  # fmt: skip
    later = {
        "command": "second", "date": "d2", "machine": "m", "lm_eval_version": "v",
        "seconds": 5.0, "arms": ["random/0.2/aware"],
        "runs": {"random/0.2/aware": {"fields": {"kv_budget": 0.2, "kv_scorer": "random"},
                                      "kept_ratio": 0.2,
                                      "scores": {"t": {"1024": {"0": 0.0, "1": 0.0}}}}},
    }  # fmt: skip
    path = tmp_path / "lm_eval.json"
    path.write_text(json.dumps(grid.add_run(committed, later)))
    grid.rerender(path)
    results = json.loads(path.read_text())
    assert results["arms"] == ["full", "attn/0.2/aware", "random/0.2/aware"]
    (row,) = [r for r in results["rows"] if r["arm"] == "random/0.2/aware"]
    assert row["accuracy"] == 0.0 and row["diff"] == -1.0
    (pair,) = results["versus"]
    assert (pair["arm"], pair["baseline"], pair["diff"]) == ("random/0.2/aware", "attn/0.2/aware",
                                                             -0.5)  # fmt: skip
    report = path.with_suffix(".md").read_text()
    assert "Command: `first`" in report and "Arms random/0.2/aware added d2: `second`" in report
    with pytest.raises(ValueError, match="attn/0.2/aware"):
        grid.add_run(committed, {**later, "arms": ["attn/0.2/aware"]})
    out = tmp_path / "out"
    assert grid.main(["--add-to", str(path), "--out", str(out), "--scorers", "attn",
                      "--budgets", "0.2", "--settings", "aware", "--no-full",
                      "--lm-eval", str(path)]) == 2  # fmt: skip
    assert not out.exists()  # refused before the run


def test_a_later_run_adds_lengths_to_the_same_arms(tmp_path):
    """``--add-lengths-to``: a run of the same arms at a new length joins a committed
    lm_eval.json (a rule that gained a length reruns only it): every arm gains the length, its
    budgeted arms pair with the full cache there, the kept fraction is the mean over both runs'
    requests; other arms, other fields or a length already recorded are refused."""
    def run(kept, scores, fields=None):
        return {"fields": fields or {"kv_budget": 0.1, "kv_scorer": "attn"}, "kept_ratio": kept,
                "command": [["lm_eval", str(sorted(scores))]], "seconds": 1.0,
                "scores": {"t": scores}}

    committed = {
        "command": "first", "date": "d1", "machine": "m", "model": "M", "lm_eval_version": "v",
        "seconds": 10.0, "arms": ["full", "a"],
        "runs": {"full": run(None, {"1024": {"0": 1.0, "1": 1.0}}, {"kv_budget": None}),
                 "a": run(0.1, {"1024": {"0": 1.0, "1": 0.0}})},
    }  # fmt: skip
    later = {
        "command": "second", "date": "d2", "machine": "m", "lm_eval_version": "v",
        "seconds": 5.0, "arms": ["full", "a"],
        "runs": {"full": run(None, {"4096": {"0": 1.0, "1": 1.0, "2": 1.0, "3": 1.0}},
                             {"kv_budget": None}),
                 "a": run(0.4, {"4096": {"0": 0.0, "1": 0.0, "2": 1.0, "3": 1.0}})},
    }  # fmt: skip
    path = tmp_path / "lm_eval.json"
    path.write_text(json.dumps(grid.add_lengths(committed, later)))
    grid.rerender(path)
    results = json.loads(path.read_text())
    assert results["arms"] == ["full", "a"]
    assert sorted(results["runs"]["a"]["scores"]["t"]) == ["1024", "4096"]
    assert abs(results["runs"]["a"]["kept_ratio"] - (0.1 * 2 + 0.4 * 4) / 6) < 1e-9
    assert len(results["runs"]["a"]["command"]) == 2
    (row,) = [r for r in results["rows"] if r["arm"] == "a" and r["length"] == 4096]
    assert row["accuracy"] == 0.5 and row["diff"] == -0.5
    report = path.with_suffix(".md").read_text()
    assert "### 4096 tokens" in report and "Lengths 4096 added d2: `second`" in report
    with pytest.raises(ValueError, match="already in the results: 4096"):
        grid.add_lengths(results, later)
    with pytest.raises(ValueError, match="arms differ"):
        grid.add_lengths(committed, {**later, "arms": ["full"]})
    other = {**later, "runs": {**later["runs"], "a": run(0.4, {"4096": {"0": 1.0}},
                                                         {"kv_budget": 0.2})}}  # fmt: skip
    with pytest.raises(ValueError, match="fields"):
        grid.add_lengths(committed, other)
    out = tmp_path / "out"
    assert grid.main(["--add-lengths-to", str(path), "--out", str(out), "--lengths", "4096",
                      "--scorers", "attn", "--budgets", "0.2", "--settings", "aware",
                      "--lm-eval", str(path)]) == 2  # fmt: skip
    assert not out.exists()  # refused before the run
