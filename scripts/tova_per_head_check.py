"""TOVA per-head vs one ranking per layer (kv_per_head) on niah_single, 512 tokens, 50 %, n=8.

The check behind the README note on the kvpress TOVA disagreement. Run:
    taskset -c 0 env VLLM_CPU_OMP_THREADS_BIND=0 VLLM_ENABLE_V1_MULTIPROCESSING=0 \\
        PYTHONPATH=. .venv/bin/python scripts/tova_per_head_check.py
"""

import math
import os

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
from vllm import LLM, SamplingParams

from obcache_vllm import model
from obcache_vllm.evidence.eval import harness, tasks

if __name__ == "__main__":
    llm = LLM(
        model=str(model.default_model_path()),
        dtype="float32",
        enforce_eager=True,
        max_model_len=2048,
        block_size=32,
        seed=0,
    )
    tok = llm.get_tokenizer()
    prompts = harness.tokenize(tasks.generate("niah_single", 512, 8, 0), tok, chat=True)
    reqs, params, labels = [], [], []
    for per_head in (True, False):
        for setting in ("query_aware", "query_agnostic"):
            for p in prompts:
                doc = len(p.document_ids)
                extra = {
                    "kv_budget": math.ceil(0.5 * doc),
                    "kv_pipeline": "tova",
                    "kv_scorer": "attn",
                    "kv_per_head": per_head,
                }
                if setting == "query_agnostic":
                    extra["kv_compress_at"] = doc
                reqs.append({"prompt_token_ids": p.ids})
                params.append(SamplingParams(temperature=0, max_tokens=16, extra_args=extra))
                labels.append((per_head, setting, p))
    outs = llm.generate(reqs, params, use_tqdm=False)
    acc = {}
    for (ph, st, p), o in zip(labels, outs, strict=True):
        acc.setdefault((ph, st), []).append(tasks.score(p.sample, o.outputs[0].text))
    for k, v in acc.items():
        print("PH_RESULT", k, sum(v) / len(v), len(v))
