"""A budget on a prompt-embeds request, on a real engine with ``enable_prompt_embeds``.

Run as a script by test_refusals.py (another engine configuration than the session engine's).
Prints one JSON line: how the budgeted prompt-embeds request was refused, the greedy tokens of
one prompt given as embeddings and as token ids (no budget), and the evictions of the same
token prompt with a budget, served by the same engine after the refusal. With ``"lift"`` in
the spec, the refusal is lifted instead (the request admitted as if its prompt were token ids)
and it prints the unbudgeted tokens, then what the budgeted request gave or how it failed.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main() -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from safetensors import safe_open
    from vllm import LLM, SamplingParams
    from vllm.exceptions import VLLMValidationError

    from obcache_vllm.textgen import haystack

    spec = json.loads(sys.argv[1])
    if spec.get("lift"):  # show what the refusal prevents (tests only): admit as token ids
        import dataclasses

        from obcache_vllm import admission

        admit = admission.Admission.admit
        admission.Admission.admit = lambda gate, requested, prompt: admit(
            gate, requested, dataclasses.replace(prompt, embeds=False))
    llm = LLM(**spec["engine"], enable_prompt_embeds=True)
    ids = llm.get_tokenizer()(haystack(12, seed=5)).input_ids
    weights = Path(spec["engine"]["model"]) / "model.safetensors"
    with safe_open(str(weights), "pt") as f:
        embeds = f.get_tensor("model.embed_tokens.weight")[ids]  # the model's own embeddings

    def greedy(prompt, **kv):
        params = SamplingParams(temperature=0, max_tokens=8, extra_args=kv or None)
        return list(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)

    if spec.get("lift"):
        print("EMBEDS_PROBE " + json.dumps({"plain": greedy({"prompt_embeds": embeds})}),
              flush=True)  # fmt: skip
        try:
            params = SamplingParams(temperature=0, max_tokens=8, extra_args={"kv_budget": 64})
            out = llm.generate([{"prompt_embeds": embeds}], params, use_tqdm=False)[0]
            got = {"budgeted": list(out.outputs[0].token_ids), "prompt_tokens": len(ids),
                   "outcome": (out.kv_transfer_params or {}).get("obcache")}  # fmt: skip
        except Exception as exc:  # the engine's own failure, reported as it surfaces here
            got = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        print("EMBEDS_PROBE " + json.dumps(got), flush=True)
        return
    refused = None
    try:
        greedy({"prompt_embeds": embeds}, kv_budget=64)
    except VLLMValidationError as exc:
        refused = {"parameter": exc.parameter, "names_embeddings": "prompt embeddings" in str(exc)}
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    before = scheduler.obcache_totals.evictions
    result = {
        "refused": refused,
        "embeds_tokens": greedy({"prompt_embeds": embeds}),
        "ids_tokens": greedy({"prompt_token_ids": ids}),
    }
    greedy({"prompt_token_ids": ids}, kv_budget=128)
    result["budgeted_ids_evictions"] = scheduler.obcache_totals.evictions - before
    print("EMBEDS_PROBE " + json.dumps(result))


if __name__ == "__main__":
    main()
