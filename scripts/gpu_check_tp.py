"""The two gpu_check.py checks that need engines of their own: full CUDA graphs refused, and
tensor parallelism (see gpu_check.py for the settings and the table)."""

from __future__ import annotations

import json
from pathlib import Path


def check_full_graphs(model, pool, batches, env, workdir, run_job, record, engine_kwargs):
    """vLLM's default FULL_AND_PIECEWISE graphs: budgets refused, unbudgeted served."""
    needle = batches[0]["requests"][0]["prompt"]
    jobs = [
        {"name": "refused", "requests": [
            {"id": "g0", "prompt": needle, "max_tokens": 4, "extra_args": {"kv_budget": 64}}]},
        {"name": "served", "requests": [
            {"id": "g1", "prompt": needle, "max_tokens": 4, "extra_args": None}]},
    ]  # fmt: skip
    try:
        # vLLM's defaults otherwise too: batch invariance could change the compilation mode.
        env = {**env, "VLLM_BATCH_INVARIANT": "0"}
        result = run_job("full-graphs", engine_kwargs(model, pool, "FULL_AND_PIECEWISE"), jobs,
                         env, workdir)  # fmt: skip
    except Exception as exc:
        record("full graphs", False, str(exc)[-1500:])
        return
    error = result["batches"]["refused"]["error"] or ""
    served = result["batches"]["served"]["outputs"].get("g1", {}).get("tokens", [])
    record("full graphs", "full CUDA graphs" in error and len(served) == 4,
           f"budget refused: {error[:160]!r}; unbudgeted served {len(served)} tokens")  # fmt: skip


def tp_size(args, model: str) -> tuple[int | None, str]:
    """The TP size to check and why (None: skip)."""
    import torch

    gpus = torch.cuda.device_count()
    config = json.loads((Path(model) / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads", 0)
    sizes = [args.tp] if args.tp else [t for t in (4, 3, 2) if t <= gpus]
    for t in sizes:
        if t <= gpus and heads % t == 0 and kv_heads % t == 0:
            return t, f"TP={t} on {gpus} GPUs"
    return None, (
        f"{gpus} GPU(s); {heads} query / {kv_heads} KV heads of {Path(model).name} allow no TP "
        f"size in {sizes or '[]'} (the default model needs 3 GPUs; --tp-model DIR for TP=2)"
    )


def check_tensor_parallel(args, model, batches, env, workdir, run_job, record, engine_kwargs):
    model = args.tp_model or model
    tp, why = tp_size(args, model)
    if tp is None:
        record("tensor parallel", None, f"skipped: {why}")
        return
    mixed = next(b for b in batches if b["name"] == "mixed")
    if args.tp_model:  # another tokenizer: token ids of the default model mean nothing to it
        from transformers import AutoTokenizer

        from obcache_vllm.textgen import needle_prompt

        tok = AutoTokenizer.from_pretrained(model)
        ids = [tok(needle_prompt(20 + 3 * i, seed=i)[0]).input_ids for i in range(5)]
        mixed = {"name": "mixed", "requests": [dict(r, prompt=ids[i])
                                               for i, r in enumerate(mixed["requests"])]}
    per_head = dict(mixed["requests"][0], id="t5",
                    extra_args={"kv_budget": 0.3, "kv_per_head": True})  # fmt: skip
    batch = [{"name": "tp", "requests": [*mixed["requests"], per_head]}]
    engine = engine_kwargs(model, args.pool_blocks, tp=tp)
    try:
        stock = run_job(f"stock-tp{tp}", engine, batch, {**env, "VLLM_PLUGINS": ""}, workdir)
        plugin = run_job(f"plugin-tp{tp}", engine, batch, env, workdir)
    except Exception as exc:
        record("tensor parallel", False, f"{why}: {str(exc)[-1500:]}")
        return
    outs, ref = plugin["batches"]["tp"]["outputs"], stock["batches"]["tp"]["outputs"]
    neighbours = [r["id"] for r in batch[0]["requests"] if not r["extra_args"]]
    same = sum(outs.get(r, {}).get("tokens") == ref.get(r, {}).get("tokens") for r in neighbours)
    budgeted = [r["id"] for r in batch[0]["requests"] if r["extra_args"]]
    evicted = sum(((outs.get(r) or {}).get("outcome") or {}).get("evictions") == 1
                  for r in budgeted)  # fmt: skip
    ok = same == len(neighbours) and evicted == len(budgeted)
    record("tensor parallel", ok,
           f"{why}: {same}/{len(neighbours)} neighbours == stock TP, {evicted}/{len(budgeted)} "
           "budgeted evicted once (per-head and one ranking per layer)")  # fmt: skip
