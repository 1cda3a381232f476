"""The analysis of scripts/error_predictor_eval.py on made-up measurements: a layer that
predicts the KL is found by the fit, a KL-unit map covers its share, a target chooses the fewest
kept tokens within it."""

from __future__ import annotations

import importlib.util
import math
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("error_predictor_eval",
                                               ROOT / "scripts" / "error_predictor_eval.py")
ep = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ep)


def _made_up(prompts: int = 24, layers: int = 4, seed: int = 0) -> dict:
    """KL = 5 x the last layer's error x a little noise; the other layers are noise."""
    rng = random.Random(seed)
    samples, curves, measured = [], {}, {}
    for i in range(prompts):
        name = f"p{i}"
        samples.append({"name": name, "kind": "a" if i % 2 else "b", "tokens": 320})
        kept = [320 - d * ep.BLOCK for d in range(9, -1, -1)]  # fewest first
        hardness = rng.uniform(0.2, 5.0)
        last = [hardness * (0.5 ** (k / 32)) if k < 320 else 0.0 for k in kept]
        layers_ = [[rng.uniform(0.01, 1.0) * (k < 320) for k in kept] for _ in range(layers - 1)]
        curves[name] = {"kept": kept, "layers": layers_ + [last]}
        measured[name] = {str(k): {"kl": 5 * e * rng.uniform(0.9, 1.1), "agree": 1.0}
                          for k, e in zip(kept[:-1], last[:-1], strict=True)}  # fmt: skip
    return {"samples": samples, "curves": curves, "measured": measured,
            "kl_targets": [0.5, 1.0, 2.0]}  # fmt: skip


def test_the_fit_finds_the_layer_that_predicts_and_ranks_better_than_the_mean():
    an = ep.analyse(_made_up())
    weights = an["ridge"]["weights"]
    assert max(range(len(weights)), key=lambda i: abs(weights[i])) == len(weights) - 1
    fit, mean = an["predictors"]["fit"], an["predictors"]["mean"]
    assert fit["equal_memory"] > 0.9 and fit["equal_memory"] > mean["equal_memory"] + 0.3
    assert an["predictors"]["last"]["equal_memory"] > 0.9  # 4 layers: the last is the last quarter


def test_kl_targets_hold_on_held_out_prompts_where_the_predictor_predicts():
    an = ep.analyse(_made_up(prompts=40))
    for row in an["predictors"]["fit"]["targets"]:
        assert row["within"] >= 0.8, row


def test_a_target_keeps_the_fewest_tokens_within_it_else_everything():
    pts = [{"kept": 64, "fraction": 0.25, "kl": 0.9}, {"kept": 128, "fraction": 0.5, "kl": 0.3},
           {"kept": 192, "fraction": 0.75, "kl": 0.1}]  # fmt: skip
    value = {64: 2.0, 128: 0.5, 192: 0.2}
    assert ep.choose(pts, lambda p: value[p["kept"]], 0.6) == (0.5, 0.3)
    assert ep.choose(pts, lambda p: value[p["kept"]], 0.1) == (1.0, 0.0)


def test_the_kl_map_covers_its_share_of_the_fitting_points():
    rng = random.Random(1)
    train = [{"errors": [e], "kl": 3 * e * math.exp(rng.gauss(0, 0.3))}
             for e in (rng.uniform(0.01, 1) for _ in range(200))]  # fmt: skip
    mapping = ep.kl_map(train, lambda e: e[0])
    covered = sum(p["kl"] <= ep.in_nats(mapping, p["errors"][0]) for p in train) / len(train)
    assert abs(covered - ep.COVER) <= 0.02
    assert abs(mapping["b"] - 1) < 0.1
