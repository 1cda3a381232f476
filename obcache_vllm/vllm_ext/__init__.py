"""The only part of obcache-vllm that imports vLLM: adapters for vLLM 0.32 (its CPU and
FlashAttention attention backends).

Entry point: :func:`obcache_vllm.vllm_ext.install.install`, called by the ``obcache`` general
plugin in every vLLM process. Nothing is imported or patched by importing this package.
"""
