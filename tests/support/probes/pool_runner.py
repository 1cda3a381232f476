"""Run one engine in THIS process on a list of requests and report what each held and got.

Usage: ``python pool_runner.py IN.json OUT.json``. IN.json: ``{"engine": {...LLM kwargs...},
"requests": [{"id": ..., "prompt_token_ids": [...], "max_tokens": n, "extra_args": {...}}]}``.
With ``VLLM_PLUGINS=`` (stock) the engine may refuse to start: OUT.json then holds
``{"start_error": message}``. Otherwise, per request: the generated token ids, or the
validation error that refused it (``{"error": message, "param": field}``), and the most blocks
it held after any step; plus the pool size and whether every block came back.

A request with ``"after": ID`` is added once request ID has finished; with ``"continues": ID``
as well, its prompt is that request's prompt and generated tokens followed by its own
``prompt_token_ids`` (a conversation's next turn). ``"lift"`` in IN.json lifts refusals to
measure why they are there: ``"speculative"`` (decode-time eviction with speculative
decoding), ``"config"`` (every refusal of the engine configuration), ``"hybrid"`` (the options
refused on interleaved sliding-window models). Under the plugin also: each budgeted request's
outcome (``obcache``, as ``usage.obcache`` reports it), the KV oracle's mismatches
(``OBCACHE_VLLM_VERIFY=1``), and with ``OBCACHE_VLLM_RECORD_KEEP=1`` the kept positions per
layer index (``kept``) and the evictions' (length, prefill) (``orders``).
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # read the scheduler between steps
    from obcache_vllm.cpu_binding import bind_in_process

    # An in-process engine ignores VLLM_CPU_OMP_THREADS_BIND (obcache_vllm/cpu_binding.py):
    # applied here, the caller's choice of core holds.
    bind_in_process()
    from vllm import LLM, SamplingParams
    from vllm.exceptions import VLLMValidationError

    spec = json.loads(open(sys.argv[1]).read())
    lifted = set(spec.get("lift", ()))  # show what a refusal prevents (tests only)
    if lifted:
        from obcache_vllm import admission

        if "speculative" in lifted:
            admission.speculative_refusal = lambda vllm_config, options: None
        if "config" in lifted:  # every refusal of the engine configuration
            admission.engine_refusal = lambda vllm_config, capabilities: None
        if "hybrid" in lifted:  # the options refused on interleaved sliding-window models
            admission.hybrid_refusal = lambda vllm_config, options: None
    out: dict = {}
    try:
        llm = LLM(**spec["engine"])
    except Exception as exc:  # stock vLLM's start-up check
        out["start_error"] = f"{type(exc).__name__}: {exc}"
        open(sys.argv[2], "w").write(json.dumps(out))
        return
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    # The group budgets evict in (a hybrid model's global layers), for stock and plugin alike.
    from obcache_vllm.vllm_ext.groups import evicting_group

    managers = scheduler.kv_cache_manager.coordinator.single_type_managers
    manager = managers[evicting_group(scheduler.kv_cache_config).index or 0]
    pool = scheduler.kv_cache_manager.block_pool
    out["pool_blocks"] = pool.get_num_free_blocks()
    results, engine_ids = {}, {}
    peak: dict[str, int] = {}
    peak_all: dict[str, int] = {}

    prompts = {r["id"]: r["prompt_token_ids"] for r in spec["requests"]}

    def add(r: dict) -> None:
        params = SamplingParams(
            temperature=0, max_tokens=r["max_tokens"], extra_args=r.get("extra_args")
        )
        prompt = r["prompt_token_ids"]
        if r.get("continues"):  # a conversation's next turn: that request's prompt and answer
            done = r["continues"]
            prompt = prompts[r["id"]] = prompts[done] + results[done]["token_ids"] + prompt
        try:
            engine_ids[engine.add_request(r["id"], {"prompt_token_ids": prompt},
                                          params)] = r["id"]  # fmt: skip
            peak[r["id"]] = 0
        except (ValueError, VLLMValidationError) as exc:
            results[r["id"]] = {"error": str(exc), "param": getattr(exc, "parameter", None)}

    # A request with "after": ID is added once request ID has finished (e.g. to adopt the
    # compressed entry it left).
    waiting = [r for r in spec["requests"] if r.get("after")]
    for r in spec["requests"]:
        if not r.get("after"):
            add(r)
    steps = 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                rid = engine_ids.get(o.request_id, o.request_id)  # engine or client id
                results[rid] = {"token_ids": list(o.outputs[0].token_ids),
                                "cached_tokens": o.num_cached_tokens}  # prefix cache, connector
                params = o.kv_transfer_params or {}
                if "obcache" in params:  # a budgeted request's outcome (usage.obcache)
                    results[rid]["obcache"] = params["obcache"]
        steps += 1
        for r in [r for r in waiting if r["after"] in results]:
            waiting.remove(r)
            add(r)
        for engine_id, rid in engine_ids.items():
            held = sum(1 for b in manager.req_to_blocks.get(engine_id, ()) if not b.is_null)
            peak[rid] = max(peak[rid], held)
            # Every group's blocks (a hybrid model's sliding-window groups too).
            every = sum(1 for m in managers for b in m.req_to_blocks.get(engine_id, ())
                        if not b.is_null)  # fmt: skip
            peak_all[rid] = max(peak_all.get(rid, 0), every)
    for rid, blocks in peak.items():
        results[rid]["peak_blocks"] = blocks
        results[rid]["peak_blocks_all_groups"] = peak_all.get(rid, 0)
    prefix = getattr(scheduler, "obcache_prefix", None)  # absent under stock vLLM
    entry_blocks = prefix.held_blocks if prefix is not None else 0  # compressed entries
    out.update(results=results, steps=steps, free_at_end=pool.get_num_free_blocks() + entry_blocks)
    out["finished"] = [
        [r.req_id, r.evictions, r.kept_prompt] for r in scheduler.obcache_finished
    ] if hasattr(scheduler, "obcache_finished") else []
    out["mismatches"] = [str(m) for m in getattr(scheduler, "obcache_mismatches", ())]
    driver = getattr(engine.engine_core.engine_core.model_executor, "driver_worker", None)
    runner = driver.worker.model_runner if driver is not None else None  # None: workers apart
    records = getattr(getattr(runner, "obcache", None), "records", None)
    if records:  # OBCACHE_VLLM_RECORD_KEEP=1: kept positions per layer index, orders
        for engine_id, rid in engine_ids.items():
            rec = records.get(engine_id, {})
            results[rid]["kept"] = {
                name.split("layers.")[1].split(".")[0]: [t.tolist() for t in rows]
                if isinstance(rows, list) else rows.tolist()
                for name, rows in rec.items() if name.endswith(":positions")
            }  # fmt: skip
            results[rid]["orders"] = [list(o) for o in rec.get(":orders", [])]
    open(sys.argv[2], "w").write(json.dumps(out))


if __name__ == "__main__":
    main()
