"""The attention adapters' declarations are what admission reads (no vLLM engine).

What each adapter serves is declared once (:data:`obcache_vllm.admission.CAPABILITIES`);
admission refuses from the platform's row, never by device type. Each adapter class must agree
with its row: its name is the backend the row names, and a capability it declares is
implemented (it overrides the methods the capability needs).
"""

from __future__ import annotations

from types import SimpleNamespace

from obcache_vllm import admission
from obcache_vllm.vllm_ext.seams import platform_backend
from obcache_vllm.vllm_ext.worker.attention import BackendAdapter


def test_the_cpu_adapter_declares_what_it_implements():
    from obcache_vllm.vllm_ext.worker.backends.cpu import ADAPTER

    assert platform_backend() == "cpu"
    declared = admission.CAPABILITIES["cpu"]
    assert ADAPTER.name == declared.adapter == "CPU_ATTN"
    assert ADAPTER.per_head_memory == declared.per_head_memory
    if declared.per_head_memory:  # the per-head read path is built, not the base's raise
        for name in ("head_reads", "attend_per_head"):
            assert getattr(type(ADAPTER), name) is not getattr(BackendAdapter, name), name


def test_the_cpu_row_serves_float_and_per_layer_fp8_caches_only():
    cpu = admission.CAPABILITIES["cpu"]
    for dtype, served in (("auto", True), ("bfloat16", True), ("fp8", True),
                          ("fp8_e5m2", True), ("fp8_per_token_head", False),
                          ("fp8_inc", False)):  # fmt: skip
        config = SimpleNamespace(cache_config=SimpleNamespace(cache_dtype=dtype, block_size=16),
                                 parallel_config=SimpleNamespace(),
                                 model_config=SimpleNamespace())  # fmt: skip
        reason = admission.platform_refusal(config, cpu)
        assert (reason is None) == served, (dtype, reason)
