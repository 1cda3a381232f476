"""One family of the supported-architectures matrix on the real engine (see
``obcache_vllm/evidence/architectures.py``): the plugin's engine and stock vLLM's in two
subprocesses (``probes/pool_runner.py``, a core each), then the HF reference in this process.

Used by ``tests/engine/test_architectures.py`` (a few families) and ``scripts/arch_matrix.py``
(all of them, results committed).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from support.engine import kept_overlap, run_pool

BS = 32
ENGINE = dict(dtype="float32", enforce_eager=True, max_model_len=2048, block_size=BS, seed=0,
              num_gpu_blocks_override=96, max_num_batched_tokens=256,
              max_num_seqs=16)  # fmt: skip
BUDGETED = {"kv_budget": 256, "kv_pipeline": "snapkv", "kv_scorer": "obcache_key",
            "kv_window": 32}  # fmt: skip
NEW_TOKENS = 16


def _engine_run(spec: dict, stock: bool, core: int) -> dict:
    env = {"OBCACHE_VLLM_RECORD_KEEP": "1", "OBCACHE_VLLM_VERIFY": "1",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}  # fmt: skip
    try:
        return run_pool(spec, stock, core, env, timeout=1200)
    except AssertionError as exc:  # the engine failed to start or to run: recorded as such
        lines = [x for x in str(exc).splitlines() if "Error" in x or "error" in x]
        return {"start_error": (lines[-1] if lines else str(exc)[-500:])[-500:]}


def run_family(family, model_dir: Path, prompt: list[int], cores: list[int]) -> dict:
    """The family's row of the matrix: parity with stock, and the budgeted request's blocks,
    kept sets and tokens against the HF reference (or its refusal)."""
    import torch

    from obcache_vllm.admission import parse_kv_options
    from obcache_vllm.evidence import hf_reference as ref

    requests = [
        {"id": "plain", "prompt_token_ids": prompt, "max_tokens": NEW_TOKENS},
        {"id": "budget", "prompt_token_ids": prompt, "max_tokens": NEW_TOKENS,
         "extra_args": BUDGETED},
    ]  # fmt: skip
    spec = {"engine": {"model": str(model_dir), **ENGINE}, "requests": requests}
    stock_spec = {**spec, "requests": requests[:1]}
    with ThreadPoolExecutor(2) as pool:
        ours = pool.submit(_engine_run, spec, False, cores[0])
        theirs = pool.submit(_engine_run, stock_spec, True, cores[-1])
        ours, theirs = ours.result(), theirs.result()
    row = {"family": family.name, "architecture": family.architecture,
           "features": family.features, "prompt_tokens": len(prompt)}  # fmt: skip
    if "start_error" in theirs:
        row.update(status="not run", reason=f"stock vLLM: {theirs['start_error']}")
        return row
    if "start_error" in ours:
        row.update(status="failed", reason=f"plugin engine: {ours['start_error']}")
        return row
    plain, budget = ours["results"]["plain"], ours["results"]["budget"]
    row["parity"] = plain.get("token_ids") == theirs["results"]["plain"].get("token_ids")
    row["blocks_back"] = ours["free_at_end"] == ours["pool_blocks"]
    row["oracle_mismatches"] = len(ours["mismatches"])
    if "error" in budget:
        row.update(status="refused", reason=budget["error"].split(" (parameter=")[0])
        return row
    outcome = budget["obcache"]
    model, _ = ref.load_model(model_dir)
    options = parse_kv_options(BUDGETED, len(prompt))
    result = ref.compress_and_generate(model, torch.tensor(prompt), options, BS, NEW_TOKENS)
    kept = {int(k): torch.tensor(v) for k, v in budget.get("kept", {}).items()}
    overlaps = [kept_overlap(kept[layer], want) for layer, want in result.kept.items()
                if layer in kept]  # fmt: skip
    row.update(
        freed_blocks=outcome["freed_blocks"], kept_tokens=outcome["prompt_tokens_kept"],
        layers_compared=len(overlaps), layers=len(result.kept),
        kept_overlap_min=min(overlaps) if overlaps else None,
        tokens_equal_reference=budget["token_ids"] == result.token_ids,
        # Random weights: how many distinct tokens the continuation has (a repeated token
        # would make "equal" weak evidence).
        distinct_tokens=len(set(budget["token_ids"])),
    )  # fmt: skip
    ok = (row["parity"] and row["blocks_back"] and not row["oracle_mismatches"]
          and outcome["freed_blocks"] > 0 and len(overlaps) == len(result.kept)
          and min(overlaps) >= 0.99 and row["tokens_equal_reference"])  # fmt: skip
    row["status"] = "served" if ok else "failed"
    return row
