"""The plugin in vLLM's tensor-parallel engine on CPU (issue #21): one engine, TP = argv size.

Run as a script by tests/engine/test_tensor_parallel_engine.py, which writes the spec (engine
keyword arguments, one prompt and one kv_* set per named request). EngineCore runs in this
process (the scheduler's ledger is readable); the ranks are vLLM's multiprocessing workers
(``distributed_executor_backend="mp"``, gloo on CPU, ``VLLM_CPU_OMP_THREADS_BIND=nobind`` so
three ranks share the two cores). Prints one JSON line ``TP_PROBE {...}``: per request the
generated tokens and the scheduler's KV outcome; per rank the kept indices of every budgeted
request (per layer, its KV heads); the free blocks after everything finished and the pool size.
"""

from __future__ import annotations

import json
import os
import sys
import time


def kept_indices(worker) -> list[dict]:
    """The rank's records in arrival order: per budgeted request, per layer, the kept indices
    [its KV heads][K] of the request's last eviction (OBCACHE_VLLM_RECORD_KEEP=1)."""
    return records_of(worker.model_runner)


def records_of(runner, last: int | None = None) -> list[dict]:
    """``last``: only the newest ``last`` records. The shared engine's runner also holds the
    records of every earlier test, some not per-layer tensors (which test ran before depends
    on the order the files run in), so its caller takes only its own batch's."""
    records = list((runner.obcache.records or {}).values())
    return [
        {layer: v.tolist() for layer, v in rec.items() if ":" not in layer}
        for rec in (records[-last:] if last else records)
    ]


def main() -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # EngineCore here, ranks in workers
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    os.environ["OBCACHE_VLLM_RECORD_KEEP"] = "1"
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc with a function
    os.environ["OBCACHE_VLLM_FAULTS"] = "1"  # a request may ask for a fault on one rank
    from vllm import LLM, SamplingParams

    spec = json.loads(sys.argv[1])
    started = time.monotonic()
    tp = spec["tp"]
    llm = LLM(**spec["engine"], tensor_parallel_size=tp,
              distributed_executor_backend="mp" if tp > 1 else None)  # fmt: skip
    ready = time.monotonic()
    names = list(spec["requests"])
    params = [
        SamplingParams(temperature=0, max_tokens=spec["max_tokens"], ignore_eos=True,
                       extra_args=spec["requests"][name] or None)
        for name in names
    ]  # fmt: skip
    prompts = [{"prompt_token_ids": spec["prompts"][name]} for name in names]
    outs = llm.generate(prompts, params, use_tqdm=False)
    done = time.monotonic()
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    result = {
        "tp": tp,
        "tokens": {n: list(o.outputs[0].token_ids) for n, o in zip(names, outs, strict=True)},
        "finish": {n: o.outputs[0].finish_reason for n, o in zip(names, outs, strict=True)},
        "evictions": scheduler.obcache_totals.evictions,
        "failures": [[*k, v] for k, v in scheduler.obcache_totals.failures.items()],
        "outcome": {n: (o.kv_transfer_params or {}).get("obcache")
                    for n, o in zip(names, outs, strict=True)},  # fmt: skip
        "kept": llm.collective_rpc(kept_indices),
        # free, or held by compressed entries (given back whenever a request needs them)
        "free_blocks": scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
        + scheduler.obcache_prefix.held_blocks,
        "pool_blocks": scheduler.kv_cache_manager.block_pool.num_gpu_blocks,
        "startup_s": round(ready - started, 1),
        "generate_s": round(done - ready, 1),
    }
    print("TP_PROBE " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
