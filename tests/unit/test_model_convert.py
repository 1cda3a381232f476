"""The real GGUF -> HF conversion, from scratch in an empty cache (about a minute)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from obcache_vllm import model

pytestmark = pytest.mark.slow


def test_real_conversion_is_complete_and_reproducible(model_home: Path, model_path: Path) -> None:
    """A cold `pull` rebuilds exactly the session's cached model (same sha256 for every file)."""
    fresh = model.pull(log=lambda _msg: None)

    assert fresh == model_home / "models" / model.MODEL_NAME != model_path
    assert model.verify(fresh) == fresh
    fresh_manifest = model.read_manifest(fresh)
    cached_manifest = model.read_manifest(model_path)
    assert fresh_manifest == cached_manifest

    config = json.loads((fresh / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["dtype"] == model.DTYPE
    assert "quantization_config" not in config
    assert (fresh / "chat_template.jinja").read_text().count("<|im_start|>") >= 2


def test_converted_tokenizer_renders_the_chat_template(model_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text.endswith(
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokenizer.eos_token == "<|im_end|>"
