"""Eviction in vLLM's real process topology (front-end -> EngineCore -> worker processes).

Run as a script by test_multiprocess.py: orders travel pickled on SchedulerOutput to the worker
process and reports come back on ModelRunnerOutput. Prints one JSON line: what the worker
recorded (kept count per layer), the generated tokens, and the request's KV outcome as the
scheduler (in the EngineCore process) reported it: its freed blocks and evictions are counted
only once the worker's report reached the scheduler.
"""

from __future__ import annotations

import json
import os
import sys


def kept_counts(worker) -> dict:
    records = worker.model_runner.obcache.records or {}
    return {
        rid: sorted({int(v.shape[1]) for k, v in rec.items() if ":" not in k})
        for rid, rec in records.items()
    }


def main() -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    os.environ["OBCACHE_VLLM_RECORD_KEEP"] = "1"
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc with a function
    from vllm import LLM, SamplingParams

    spec = json.loads(sys.argv[1])
    llm = LLM(**spec["engine"])
    params = SamplingParams(temperature=0, max_tokens=8, extra_args=spec["kv"])
    out = llm.generate([{"prompt_token_ids": spec["prompt"]}], params, use_tqdm=False)
    kept = llm.collective_rpc(kept_counts)[0]
    outcome = (out[0].kv_transfer_params or {}).get("obcache")
    result = {"kept": kept, "tokens": list(out[0].outputs[0].token_ids), "outcome": outcome}
    print("MP_PROBE " + json.dumps(result))


if __name__ == "__main__":
    main()
