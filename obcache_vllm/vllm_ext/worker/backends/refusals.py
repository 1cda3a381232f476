"""What each attention backend's adapter refuses, from the engine configuration alone.

Plain functions of ``vllm_config`` (no vLLM or torch import), and each adapter's declared
capabilities: the API server reads them through
:func:`obcache_vllm.vllm_ext.frontend.admission.bind_platform`, without importing the worker's
classes. The reasons of FLASH_ATTN are explained in :mod:`.flash_attn`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Capabilities:
    """What an adapter serves beyond plain eviction, declared once here (its class reads its
    row, admission reads the platform's; neither decides by device type).

    ``per_head_memory``: a pipeline whose KV heads own their memory (adakv) can run (the
    adapter implements ``head_reads`` / ``attend_per_head``). ``several_groups``: budgets on
    a model with several KV-cache groups (Gemma 2 and 3: a global group evicts, sliding-window
    groups run as stock); FlashAttention shifts the batch's sequence lengths in place, in a
    tensor vLLM shares between the groups, so it cannot.
    """

    per_head_memory: bool = False
    several_groups: bool = False


# By seam-registry backend name (``platform_backend``: "cpu", "cuda", "none").
CAPABILITIES: dict[str, Capabilities] = {
    "cpu": Capabilities(per_head_memory=True, several_groups=True),
    "cuda": Capabilities(),
    "none": Capabilities(),
}

BACKEND_NAME = "FLASH_ATTN"
KERNEL_BLOCK_MULTIPLE = 16  # FlashAttentionBackend.get_supported_kernel_block_sizes


# vLLM --kv-cache-dtype values whose values a float cache holds (no quantization).
FLOAT_KV_DTYPES = ("auto", "bfloat16", "float16", "float32")
# Quantized KV dtypes the CPU adapter reads: fp8 bytes with one scale per layer for keys and
# one for values (obcache_vllm/eviction/quantized.py). Not fp8_per_token_head (scales per
# token and head, stored beside the cache) nor fp8_inc / fp8_ds_mla (other layouts).
CPU_FP8_KV_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2")


def _kv_dtype_refusal(vllm_config, served: tuple[str, ...]) -> str | None:
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    if cache_dtype in FLOAT_KV_DTYPES or cache_dtype in served:
        return None
    also = f"; {', '.join(served)} are" if served else ""
    return (f"quantized KV cache ({cache_dtype}) is not supported with kv_budget on this "
            f"backend (float KV caches{also} served)")  # fmt: skip


def cpu_refusal(vllm_config) -> str | None:
    """CPU_ATTN: every CPU configuration the engine accepts (the generic checks apply), with a
    float or a per-layer-scaled fp8 KV cache."""
    return _kv_dtype_refusal(vllm_config, CPU_FP8_KV_DTYPES)


def unsupported_platform(vllm_config) -> str | None:
    return "KV eviction is implemented for vLLM's CPU and CUDA (FLASH_ATTN) backends only"


def flash_attn_refusal(vllm_config) -> str | None:
    """FLASH_ATTN on CUDA: why budgeted requests cannot be served, or None."""
    quantized = _kv_dtype_refusal(vllm_config, ())  # its view moves float pages only
    if quantized is not None:
        return quantized
    attention = vllm_config.attention_config
    backend = getattr(attention.backend, "name", attention.backend)
    if backend != BACKEND_NAME or getattr(attention, "backend_per_kind", None):
        return (
            "kv_budget on CUDA needs --attention-backend FLASH_ATTN (the automatic choice "
            "is made in the worker, after this check)"
        )
    mode = vllm_config.compilation_config.cudagraph_mode
    if mode is not None and mode.has_full_cudagraphs():
        return (
            f"kv_budget is not supported with full CUDA graphs (cudagraph_mode={mode.name}): "
            "use -cc.cudagraph_mode=PIECEWISE or --enforce-eager"
        )
    block_size = vllm_config.cache_config.block_size
    if block_size is not None and block_size % KERNEL_BLOCK_MULTIPLE:
        return f"kv_budget on FLASH_ATTN needs a block size multiple of 16, got {block_size}"
    parallel = vllm_config.parallel_config
    if getattr(parallel, "decode_context_parallel_size", 1) > 1 or (
        getattr(parallel, "prefill_context_parallel_size", 1) > 1
    ):
        return "context parallelism is not supported with kv_budget"
    if getattr(parallel, "enable_dbo", False):
        return "dual-batch overlap (micro-batching) is not supported with kv_budget"
    if getattr(vllm_config.cache_config, "kv_sharing_fast_prefill", False):
        return "KV-sharing fast prefill is not supported with kv_budget"
    model = vllm_config.model_config
    text = getattr(model, "hf_text_config", None)
    if getattr(text, "alibi", False) or getattr(text, "position_embedding_type", "") == "alibi":
        return "ALiBi models are not supported with kv_budget on FLASH_ATTN"
    if getattr(model, "is_mm_prefix_lm", False) or getattr(model, "rswa_window", None):
        return "prefix-LM / R-SWA attention masks are not supported with kv_budget"
    return None
