"""The supported-architectures matrix: one tiny model per family, random weights, real layouts.

Each family's model is written locally from its HF config class (two layers, a hidden size of
256, four query heads over two KV heads of 64 dims, the default model's tokenizer and
vocabulary), with the features that family differs by left as the family has them: q/k/v
biases (Qwen2), QK-norm (Qwen3, OLMo 2), a fused QKV projection (Phi-3), logit soft-capping and
interleaved sliding windows (Gemma 2), scaled attention and residuals (Granite). Nothing comes
from a hub: the weights are drawn with a fixed seed and saved to disk, and vLLM serves that
directory like any other.

Per family, on the real engine (:func:`run_family`):

* **parity**: a request without a budget gives stock vLLM's tokens (a second engine, the
  plugin disabled, the same settings);
* **a budget**: a budgeted request frees blocks, keeps the positions the HF reference keeps
  (:mod:`obcache_vllm.evidence.hf_reference` on the same weights; overlap per layer and KV
  head) and continues with its tokens; or it is refused at admission, and the reason is
  recorded.

``scripts/arch_matrix.py`` runs every family and writes ``results/architectures/`` (JSON and
the Supported models page's table); the suite runs a few (``tests/engine/test_architectures.py``).
This module imports torch and transformers only: the engines run in subprocesses.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

# Small enough to start in seconds on one core, large enough for several blocks per head.
COMMON = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=64,
              max_position_embeddings=4096, initializer_range=0.08,
              tie_word_embeddings=False)  # fmt: skip


@dataclass(frozen=True)
class Family:
    """One architecture family: its HF config class, what differs, the settings that make it
    that family (``config``), and the features the eviction path meets there."""

    name: str
    config_class: str
    architecture: str
    features: str
    config: dict = field(default_factory=dict)


FAMILIES: tuple[Family, ...] = (
    Family("llama", "LlamaConfig", "LlamaForCausalLM", "separate q/k/v, RoPE (the baseline)"),
    Family("qwen2", "Qwen2Config", "Qwen2ForCausalLM", "q/k/v projection biases",
           {"use_sliding_window": False}),
    Family("qwen3", "Qwen3Config", "Qwen3ForCausalLM", "QK-norm (RMSNorm per head before RoPE)",
           {"use_sliding_window": False}),
    Family("mistral", "MistralConfig", "MistralForCausalLM", "Mistral layout, no sliding window",
           {"sliding_window": None}),
    Family("phi3", "Phi3Config", "Phi3ForCausalLM", "fused QKV projection",
           {"sliding_window": None, "pad_token_id": 0}),
    Family("olmo2", "Olmo2Config", "Olmo2ForCausalLM",
           "QK-norm over the whole projection, norms after attention", {"pad_token_id": 0}),
    Family("granite", "GraniteConfig", "GraniteForCausalLM",
           "attention, residual, embedding and logit multipliers",
           {"attention_multiplier": 0.1, "residual_multiplier": 0.5, "embedding_multiplier": 4.0,
            "logits_scaling": 2.0}),
    Family("gemma2", "Gemma2Config", "Gemma2ForCausalLM",
           "logit soft-capping, interleaved sliding-window and global layers",
           {"sliding_window": 256, "query_pre_attn_scalar": 64, "pad_token_id": 0,
            "tie_word_embeddings": True}),  # vLLM's Gemma 2 always ties them
)  # fmt: skip
BY_NAME = {f.name: f for f in FAMILIES}

# Stands for the tokenizer's vocabulary size in a family's config (Gemma 3n's per-layer input
# embeddings default to 262,144 rows).
PER_LAYER_VOCAB = "tokenizer vocabulary"

# Layouts whose budgets are refused, written the same way to show the refusal is still needed
# (``tests/engine/test_refusals_needed.py``: the refusal lifted, the budget goes wrong).
REFUSED_FAMILIES: tuple[Family, ...] = (
    Family("mistral-window", "MistralConfig", "MistralForCausalLM",
           "a sliding window in every layer", {"sliding_window": 128}),
    Family("deepseek-mla", "DeepseekV2Config", "DeepseekV2ForCausalLM",
           "multi-head latent attention (MLA: one latent KV of 512 + 64 dims)",
           {"kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 64,
            "qk_rope_head_dim": 64, "v_head_dim": 64, "first_k_dense_replace": 2,
            "n_routed_experts": 2, "num_experts_per_tok": 1, "n_shared_experts": 1,
            "moe_intermediate_size": 64, "pad_token_id": 0}),
    Family("gemma3n-shared", "Gemma3nTextConfig", "Gemma3nForCausalLM",
           "KV-sharing layers (the last two of six read an earlier layer's KV cache), "
           "interleaved sliding-window and global layers",
           {"num_hidden_layers": 6, "layer_types": ["sliding_attention", "full_attention"] * 3,
            "num_kv_shared_layers": 2, "sliding_window": 128,
            "activation_sparsity_pattern": [0.0] * 6, "hidden_size_per_layer_input": 16,
            "vocab_size_per_layer_input": PER_LAYER_VOCAB, "laurel_rank": 16,
            "pad_token_id": 0, "tie_word_embeddings": True}),  # vLLM's Gemma 3n ties them
)  # fmt: skip
BY_NAME.update({f.name: f for f in REFUSED_FAMILIES})


def write_model(family: Family, out: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """The family's tiny model with random weights (``seed``) and the tokenizer of
    ``tokenizer_dir``, saved as an HF directory ``out`` (float32 safetensors). Idempotent."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    marker = out / "obcache_family.json"
    spec = {"family": family.name, "seed": seed, "common": COMMON, "config": family.config}
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return out
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    cls = getattr(transformers, family.config_class)
    settings = {k: len(tokenizer) if v == PER_LAYER_VOCAB else v
                for k, v in {**COMMON, **family.config}.items()}  # fmt: skip
    config = cls(**settings, vocab_size=len(tokenizer),
                 bos_token_id=tokenizer.bos_token_id,
                 eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    config.architectures = [family.architecture]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if out.exists():
        shutil.rmtree(out)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    marker.write_text(json.dumps(spec))
    return out
