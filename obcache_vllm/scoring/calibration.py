"""KL targets: a request's KL from the full cache, predicted from every layer's error.

An error target (``kv_budget: {"max_error": e}``) chooses the fewest kept tokens whose error,
the mean over layers of each layer's relative change of its window outputs
(:mod:`obcache_vllm.scoring.estimate`), is at most ``e``. That unit ranks requests by what
eviction does to their output poorly (``scripts/error_predictor_eval.py``: Spearman 0.25 with the
measured KL among held-out prompts at equal memory), and it is not one a user can state.

A KL target (``kv_budget: {"max_kl": nats}``) is stated in nats of the KL divergence of the
next-token distributions from the full cache's, and chosen by a per-model *calibration*,
fitted on prompts the model was measured on and checked on others:

* a ridge regression of log KL on every layer's log error (one weight per layer: which
  layers' errors reach the output), ``log p = intercept + sum_l w_l log(err_l + 1e-9)``;
* a power law from ``p`` to nats with a margin, ``nats = exp(a + margin + b log p)``, on
  out-of-fold predictions: the margin starts at the 90 % quantile of the residuals and is
  raised until the count a target chooses (each prompt's fewest kept tokens predicted within
  it) leaves 90 % of the fitting prompts within every measured target, so that about 9 in 10
  prompts like them get what they ask (the residual quantile alone covers 9 in 10 points,
  not choices: a target picks the count where the map under-states the KL most).

A calibration holds for the selection it was measured with (pipeline, window, per-head
ranking, scorer; a whole-prompt compression at the prompt's end, no decode-time eviction)
and for its model: admission refuses a KL target otherwise, naming the field
(:func:`obcache_vllm.admission.request_refusal`). A model may ship several, one per selection
(:func:`for_model`; :func:`closest` picks the one a request's selection is nearest).
Calibrations ship in ``obcache_vllm/calibrations/<model directory name>@<selection>.json``
(:func:`file_name`), written by ``scripts/error_predictor_eval.py --write-calibration`` from its
measurement.

Plain Python and torch: no vLLM import.
"""

from __future__ import annotations

import glob
import json
import math
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch
from torch import Tensor

CALIBRATIONS = Path(__file__).resolve().parents[1] / "calibrations"
# The setting a calibration was measured with: the request's fields must match it.
SETTING_FIELDS = ("pipeline", "window", "per_head", "scorer")


@dataclass(frozen=True)
class KlCalibration:
    """One model's map from its layers' errors to nats (see the module docstring)."""

    model: str
    num_layers: int
    intercept: float
    weights: tuple[float, ...]
    map_a: float
    map_b: float
    margin: float
    setting: dict
    source: str = ""

    def __post_init__(self) -> None:
        if len(self.weights) != self.num_layers:
            raise ValueError(f"{len(self.weights)} weights for {self.num_layers} layers")

    def nats(self, curves: Tensor) -> Tensor:
        """Predicted KL (nats) of each candidate: ``curves`` [L, C], every layer's error of
        each candidate kept count (layers in the model's order) -> [C] float64."""
        if curves.shape[0] != self.num_layers:
            raise ValueError(f"{curves.shape[0]} layers' errors for a {self.num_layers}-layer "
                             "calibration")  # fmt: skip
        feats = torch.log(curves.to(torch.float64).clamp_min(0.0) + 1e-9)
        w = torch.tensor(self.weights, dtype=torch.float64).unsqueeze(1)
        log_p = (self.intercept + (w * feats).sum(dim=0)).clamp_min(math.log(1e-12))
        return torch.exp(self.map_a + self.margin + self.map_b * log_p)

    def mismatch(self, options) -> tuple[str, str] | None:
        """``(field, why)`` where ``options`` (KvRequest or KvOptions) are not the calibrated
        setting, or None."""
        for name in SETTING_FIELDS:
            if getattr(options, name) != self.setting[name]:
                shown = ", ".join(f"kv_{k} {json.dumps(v)}" for k, v in self.setting.items())
                return (f"kv_{name}", f"{json.dumps(getattr(options, name))}: {self.model}'s "
                        f"KL calibration was measured with {shown}")  # fmt: skip
        return None

    def to_json(self) -> dict:
        return {"model": self.model, "num_layers": self.num_layers,
                "intercept": self.intercept, "weights": list(self.weights),
                "map": {"a": self.map_a, "b": self.map_b, "margin": self.margin},
                "setting": self.setting, "source": self.source}  # fmt: skip

    @classmethod
    def from_json(cls, data: dict) -> KlCalibration:
        return cls(model=data["model"], num_layers=int(data["num_layers"]),
                   intercept=float(data["intercept"]),
                   weights=tuple(float(w) for w in data["weights"]),
                   map_a=float(data["map"]["a"]), map_b=float(data["map"]["b"]),
                   margin=float(data["map"]["margin"]), setting=dict(data["setting"]),
                   source=data.get("source", ""))  # fmt: skip


def model_key(model: str) -> str:
    """The calibration name of a served model: its directory's (or hub id's) last part."""
    return Path(str(model).rstrip("/")).name


def file_name(model: str, setting: dict) -> str:
    """The file a calibration of ``model`` measured with ``setting`` ships as:
    ``<model>@<pipeline>-w<window>[-shared]-<scorer>.json``."""
    shared = "" if setting["per_head"] else "-shared"
    return (f"{model_key(model)}@{setting['pipeline']}-w{setting['window']}{shared}-"
            f"{setting['scorer']}.json")


@cache
def for_model(model: str, num_layers: int) -> tuple[KlCalibration, ...]:
    """The shipped calibrations of ``model`` (a path or a hub id), one per selection measured,
    in file-name order; empty where none ships or their layer count is not the model's
    (another model under the same name)."""
    key = model_key(model)
    found = []
    for path in sorted(CALIBRATIONS.glob(f"{glob.escape(key)}@*.json")):
        calibration = KlCalibration.from_json(json.loads(path.read_text()))
        if calibration.model == key and calibration.num_layers == num_layers:
            found.append(calibration)
    return tuple(found)


def closest(calibrations: tuple[KlCalibration, ...], options) -> KlCalibration | None:
    """The calibration measured with ``options``' selection (KvRequest or KvOptions), else the
    one sharing most of its selection fields (the first of equals), or None where there is
    none: what a KL target naming no selection is served with, and what a refusal names."""
    if not calibrations:
        return None

    def shared(calibration: KlCalibration) -> int:
        return sum(getattr(options, k) == calibration.setting[k] for k in SETTING_FIELDS)

    return max(calibrations, key=shared)  # max keeps the first of equals


def shipped() -> list[str]:
    """The model names a calibration ships for."""
    return sorted({p.name.split("@", 1)[0] for p in CALIBRATIONS.glob("*@*.json")})
