"""The CPU attention adapter's declarations are what admission reads (no vLLM engine).

``install`` binds the platform adapter's refusal and capabilities into admission, which then
decides by them, never by device type. The adapter class must agree with the row it reads:
a capability it declares is implemented (it overrides the methods the capability needs), and
its own ``unsupported_reason`` is the refusal admission is bound to.
"""

from __future__ import annotations

from types import SimpleNamespace

from obcache_vllm.vllm_ext.worker.attention import BackendAdapter
from obcache_vllm.vllm_ext.worker.backends import (
    platform_backend,
    platform_capabilities,
    platform_refusal,
    refusals,
)


def test_the_cpu_adapter_declares_what_it_implements():
    from obcache_vllm.vllm_ext.worker.backends.cpu import ADAPTER

    assert platform_backend() == "cpu"
    declared = platform_capabilities()
    assert declared == refusals.CAPABILITIES["cpu"]
    assert ADAPTER.per_head_memory == declared.per_head_memory
    if declared.per_head_memory:  # the per-head read path is built, not the base's raise
        for name in ("head_reads", "attend_per_head"):
            assert getattr(type(ADAPTER), name) is not getattr(BackendAdapter, name), name


def test_the_cpu_adapters_refusal_is_the_one_admission_is_bound_to():
    from obcache_vllm.vllm_ext.worker.backends.cpu import ADAPTER

    assert platform_refusal() is refusals.cpu_refusal
    for dtype in ("auto", "fp8", "fp8_e5m2", "fp8_per_token_head", "fp8_inc"):
        config = SimpleNamespace(cache_config=SimpleNamespace(cache_dtype=dtype))
        assert ADAPTER.unsupported_reason(config) == platform_refusal()(config), dtype
    assert ADAPTER.unsupported_reason(
        SimpleNamespace(cache_config=SimpleNamespace(cache_dtype="fp8_inc"))) is not None
