"""The fidelity evaluation's pure parts: arms, samples, per-request statistics, the paired
bootstrap and the report (no vLLM; the engine run is tests/engine/test_fidelity.py)."""

from __future__ import annotations

import pytest

from obcache_vllm.evidence import fidelity as fid


def test_arms_cover_the_grid_once_with_the_control_first():
    arms = fid.arms(["tova", "streaming"], ["attn", "obcache_key"], [0.1, 0.2],
                    ["aware", "agnostic"])  # fmt: skip
    assert arms[0].name == "full" and arms[0].kv(fid.Sample("s", "code", (1,) * 10, 8)) is None
    names = [a.name for a in arms[1:]]
    assert len(names) == len(set(names)) == 2 * 2 * (2 + 1)  # streaming once per cell
    sample = fid.Sample("s", "needle", tuple(range(100)), 80)
    agnostic = next(a for a in arms if a.name == "tova+obcache_key@0.1/agnostic")
    assert agnostic.kv(sample) == {"kv_budget": 0.1, "kv_pipeline": "tova",
                                   "kv_scorer": "obcache_key", "kv_decode": False,
                                   "kv_compress_at": 80}  # fmt: skip
    aware = next(a for a in arms if a.name == "streaming+-@0.2/aware")
    assert "kv_compress_at" not in aware.kv(sample)


def test_slices_are_seeded_windows_of_the_text():
    ids = list(range(1000))
    a = fid.slices(ids, 3, 100, seed=1)
    assert a == fid.slices(ids, 3, 100, seed=1) and a != fid.slices(ids, 3, 100, seed=2)
    for w in a:
        assert len(w) == 100 and w == list(range(w[0], w[0] + 100))
    with pytest.raises(ValueError, match="shorter"):
        fid.slices(ids[:50], 1, 100, seed=0)


def test_request_stats_and_first_divergence():
    positions = {0: (0.0, True, -0.1), 1: (0.5, True, -0.2), 2: (1.0, False, -3.0),
                 3: (0.1, True, -0.1)}  # fmt: skip
    s = fid.request_stats(positions, 4)
    assert s["kl"] == pytest.approx(1.6 / 4) and s["kl_max"] == 1.0
    assert s["agree"] == 0.75 and s["first_divergence"] == 2
    assert fid.request_stats({0: (0.0, True, 0.0)}, 1)["first_divergence"] == 1  # never
    with pytest.raises(ValueError, match="not compared"):
        fid.request_stats({0: (0.0, True, 0.0)}, 2)


def test_paired_bootstrap_interval_brackets_the_mean_and_pairs_the_draws():
    draws = fid.bootstrap_draws(5, reps=500, seed=3)
    mean, lo, hi = fid.interval([1.0, 2.0, 3.0, 4.0, 5.0], draws)
    assert mean == 3.0 and lo < mean < hi and 1.0 <= lo and hi <= 5.0
    assert fid.interval([2.0] * 5, draws) == (2.0, 2.0, 2.0)
    # A constant paired difference has a zero-width interval even when the values vary a lot.
    rows = {s: {"kl": float(i), "agree": 1.0, "first_divergence": 4, "kept_fraction": 0.2}
            for i, s in enumerate("abcde")}  # fmt: skip
    shifted = {s: dict(r, kl=r["kl"] + 0.5) for s, r in rows.items()}
    per_request = {"tova+attn@0.2/aware": rows, "tova+obcache_key@0.2/aware": shifted}
    summary = fid.summarize(per_request, list("abcde"))
    assert summary["tova+obcache_key@0.2/aware"]["kl_minus_attn"] == [0.5, 0.5, 0.5]
    assert "kl_minus_attn" not in summary["tova+attn@0.2/aware"]
    assert summary["tova+attn@0.2/aware"]["kl"][1] < 2.0 < summary["tova+attn@0.2/aware"]["kl"][2]


def test_report_renders_every_arm(tmp_path):
    rows = {s: {"kl": 0.1, "agree": 0.9, "first_divergence": 7, "kept_fraction": 0.2}
            for s in "ab"}  # fmt: skip
    full = {s: {"kl": 0.0, "agree": 1.0, "first_divergence": 8, "kept_fraction": 1.0}
            for s in "ab"}  # fmt: skip
    per_request = {"full": full, "tova+attn@0.2/aware": rows, "snapkv+attn@0.1/agnostic": rows}
    results = {"command": "obcache-vllm eval fidelity", "model_name": "m", "date": "d",
               "seconds": 1.0, "kinds": "code", "prompt_tokens": 64, "tokens": 8,
               "samples": [{"name": "a"}, {"name": "b"}], "per_request": per_request,
               "summary": fid.summarize(per_request, ["a", "b"])}  # fmt: skip
    paths = fid.write_reports(results, tmp_path)
    text = (tmp_path / "fidelity.md").read_text()
    for arm in per_request:
        assert f"| {arm} |" in text
    assert text.index("| full |") < text.index("agnostic") < text.index("/aware |")
    assert (tmp_path / "fidelity.json").exists() and len(paths) >= 2


def test_code_text_is_pythons_own_source():
    text = fid.code_text()
    assert "class ArgumentParser" in text and len(text) > 100_000


def test_the_command_line_knows_the_same_kinds_and_scorers():
    from obcache_vllm.evidence.eval import command, grid

    assert command.FIDELITY_KINDS == fid.KINDS and command.FIDELITY_SETTINGS == fid.SETTINGS
    assert tuple(grid.SCORERS) == fid.SCORERS
