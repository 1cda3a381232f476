"""Helpers shared by the engine benchmarks (bench_prefill.py, bench_decode.py).

Every configuration runs in a fresh child process so that stock vLLM (``VLLM_PLUGINS=``, plugin
disabled) and the plugin engine see identical settings. vLLM logs to stdout, so a child reports
its result as one JSON line prefixed with :data:`MARK`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

SCORERS = ("attn", "obcache_value", "obcache_key", "obcache_joint")
BLOCK = 32
MARK = "BENCH_RESULT "


def engine(model: str, pool_blocks: int | None, max_len: int, **extra):
    """A vLLM engine with the project's CPU settings (fp32, eager, 32-token blocks, seed 0).

    The children build it in their own process, where vLLM ignores
    ``VLLM_CPU_OMP_THREADS_BIND``: it is applied here (one torch thread per listed core)."""
    from vllm import LLM

    from obcache_vllm.cpu_binding import bind_in_process

    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
        bind_in_process()
    kw = dict(model=model, dtype="float32", enforce_eager=True, max_model_len=max_len,
              block_size=BLOCK, seed=0, **extra)
    if pool_blocks:
        kw["num_gpu_blocks_override"] = pool_blocks
    return LLM(**kw)


def prompts(tokenizer, count: int, tokens: int, seed: int) -> list[list[int]]:
    """``count`` deterministic haystack prompts of exactly ``tokens`` token ids."""
    from obcache_vllm.textgen import haystack

    out = []
    for i in range(count):
        ids = tokenizer(haystack(tokens // 20, seed + i)).input_ids
        out.append(ids[:tokens])
    return out


def mixed_prompts(tokenizer, count: int, tokens: int, seed: int) -> list[list[int]]:
    """``count`` prompts of exactly ``tokens`` ids, dense and redundant in turn: a haystack
    (many distinct facts), then one haystack passage of 64-256 tokens repeated to length."""
    import random

    dense = prompts(tokenizer, count, tokens, seed)
    rng = random.Random(seed)
    out = []
    for i, ids in enumerate(dense):
        if i % 2:
            period = rng.randrange(64, 257)
            unit = ids[:period]
            ids = (unit * -(-tokens // period))[:tokens]
        out.append(ids)
    return out


def parser(doc: str, mode: str):
    """The benchmark's argument parser with what every script takes: its (single) mode, the
    model, and the hidden child flags of :func:`run_child`."""
    import argparse

    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("mode", nargs="?", default=mode, choices=[mode], help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help="model dir (default: the provisioned model)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--stock", action="store_true", help=argparse.SUPPRESS)
    return ap


def parse(ap, worker):
    """Parsed arguments for the parent, or ``None`` after a child has run ``worker`` and
    printed its result."""
    args = ap.parse_args()
    args.model = default_model(args.model)
    if args.child:
        emit(worker(args))
        return None
    return args


def default_model(model: str | None) -> str:
    """``model``, or the provisioned default model's directory."""
    if model is not None:
        return model
    from obcache_vllm import model as model_mod

    return str(model_mod.pull(log=lambda m: None))


def emit(result: dict) -> None:
    """Child side: print the result line the parent looks for."""
    print(MARK + json.dumps(result), flush=True)


def run_child(script: str, mode: str, stock: bool, extra: list[str],
              env_extra: dict | None = None) -> dict:
    """Run ``script mode --child [--stock] extra...`` and return its result line.

    One core by default: on a shared 2-core machine, OpenMP barriers across both cores make
    every small op wait for a descheduled thread (set VLLM_CPU_OMP_THREADS_BIND to override).
    """
    env = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0", **os.environ,
           "VLLM_USE_V2_MODEL_RUNNER": "0", **(env_extra or {})}
    if stock:
        env["VLLM_PLUGINS"] = ""
    cmd = [sys.executable, script, mode, "--child"] + (["--stock"] if stock else []) + extra
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"child failed: {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    line = next(x for x in proc.stdout.splitlines() if x.startswith(MARK))
    return json.loads(line.removeprefix(MARK))
