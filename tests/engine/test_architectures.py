"""A few families of the supported-architectures matrix in the suite (all of them:
``scripts/arch_matrix.py``, results in ``results/architectures/``).

Each family's tiny random-weight model (``obcache_vllm/evidence/architectures.py``) is served by
the plugin's engine and by stock vLLM (two subprocesses, ``tests/support/arch.py``): a request
without a budget gives stock's tokens; a budgeted one frees blocks, keeps per layer and KV head
the positions the HF reference keeps (its queries read where the model hands them to attention,
after QK-norm and RoPE) and continues with its tokens; in a hybrid sliding-window model
(Gemma 2: two KV-cache groups) the budget evicts in the global layer only, as the reference
does. Chosen: QK-norm (Qwen3), a fused QKV projection (Phi-3) and the hybrid one (Gemma 2).
"""

from __future__ import annotations

import os

import pytest
from support.arch import run_family

from obcache_vllm.evidence.architectures import BY_NAME, write_model
from obcache_vllm.textgen import haystack

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def prompt(tokenizer) -> list[int]:
    return tokenizer(haystack(40, seed=5)).input_ids[:640]


@pytest.mark.parametrize("name", ["qwen3", "phi3", "gemma2"])
def test_family(name, prompt, model_path, tmp_path_factory):
    family = BY_NAME[name]
    model_dir = write_model(family, tmp_path_factory.mktemp(name), model_path)
    row = run_family(family, model_dir, prompt, sorted(os.sched_getaffinity(0)))
    assert row["status"] == "served", row
    assert row["parity"] and row["blocks_back"] and not row["oracle_mismatches"], row
    assert row["freed_blocks"] > 0 and row["kept_overlap_min"] >= 0.99, row
    assert row["tokens_equal_reference"], row
    assert row["layers_compared"] == row["layers"] == (1 if name == "gemma2" else 2), row
