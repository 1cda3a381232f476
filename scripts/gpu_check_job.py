"""One engine of scripts/gpu_check.py: run its batches, write what happened as JSON.

Usage: ``python scripts/gpu_check_job.py JOB.json OUT.json`` (the environment, e.g.
``VLLM_PLUGINS=`` for stock vLLM, is set by gpu_check.py). JOB: ``{"engine": {LLM kwargs},
"batches": [{"name": ..., "requests": [{"id", "prompt", "max_tokens", "ignore_eos",
"extra_args"}]}]}``. Each batch is submitted at once and stepped to the
end. With the engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one GPU) every
step also records the scheduler's view: running requests, free blocks, blocks each request
holds. OUT: ``{"classes": {...}, "pool_blocks": n, "batches": {name: {"outputs": {id:
{"tokens", "outcome"}}, "trace": [...], "error": str | None}}}``.
"""

from __future__ import annotations

import json
import sys
import traceback


def _internals(llm):
    """(scheduler, runner) when EngineCore and the worker run in this process, else None."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    if core is None:
        return None
    worker = getattr(core.model_executor, "driver_worker", None)
    runner = getattr(getattr(worker, "worker", None), "model_runner", None)
    return core.scheduler, runner


def _live_blocks(scheduler, req_id: str) -> int:
    manager = scheduler.kv_cache_manager.coordinator.single_type_managers[0]
    return sum(1 for b in manager.req_to_blocks.get(req_id, []) if not b.is_null)


def run_batch(llm, batch: dict, internals) -> dict:
    from vllm import SamplingParams

    engine = llm.llm_engine
    ids = {}
    for r in batch["requests"]:
        params = SamplingParams(
            temperature=0, max_tokens=r["max_tokens"], ignore_eos=r.get("ignore_eos", False),
            extra_args=r.get("extra_args") or None,
        )  # fmt: skip
        internal = engine.add_request(r["id"], {"prompt_token_ids": r["prompt"]}, params)
        ids[internal if isinstance(internal, str) else r["id"]] = r["id"]
    outputs, trace = {}, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outcome = (out.kv_transfer_params or {}).get("obcache")
                outputs[ids.get(out.request_id, out.request_id)] = {
                    "tokens": list(out.outputs[0].token_ids), "outcome": outcome,
                }  # fmt: skip
        if internals is not None:
            sched = internals[0]
            pool = sched.kv_cache_manager.block_pool
            trace.append({
                "running": len(sched.running),
                "free": pool.get_num_free_blocks(),
                "held": {ids.get(k, k): _live_blocks(sched, k) for k in sched.requests},
                "computed": {ids.get(k, k): q.num_computed_tokens
                             for k, q in sched.requests.items()},
            })  # fmt: skip
    return {"outputs": outputs, "trace": trace, "error": None}


def main() -> None:
    job = json.loads(open(sys.argv[1]).read())
    from vllm import LLM

    llm = LLM(**job["engine"])
    internals = _internals(llm)
    result = {"classes": {}, "pool_blocks": None, "batches": {}}
    if internals is not None:
        sched, runner = internals
        result["classes"] = {
            "scheduler": type(sched).__name__,
            "runner": type(runner).__name__ if runner is not None else None,
            "backends": sorted({g.backend.__name__ for gs in runner.attn_groups for g in gs})
            if runner is not None else [],
            "builders": sorted({type(b).__name__ for gs in runner.attn_groups for g in gs
                                for b in g.metadata_builders}) if runner is not None else [],
        }  # fmt: skip
        result["pool_blocks"] = sched.kv_cache_manager.block_pool.get_num_free_blocks()
    for batch in job["batches"]:
        try:
            result["batches"][batch["name"]] = run_batch(llm, batch, internals)
        except Exception as exc:  # recorded; an expected refusal is checked by gpu_check.py
            result["batches"][batch["name"]] = {
                "outputs": {}, "trace": [], "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc()[-3000:],
            }  # fmt: skip
            for rid in [r["id"] for r in batch["requests"]]:  # leave the engine clean
                try:
                    llm.llm_engine.abort_request([rid])
                except Exception:
                    pass
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
