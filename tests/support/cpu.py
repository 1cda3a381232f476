"""What this CPU lets vLLM's CPU backend run, for tests that need more than plain x86-64.

vLLM 0.32's CPU attention stores and reads an fp8 KV cache (``--kv-cache-dtype fp8``,
``fp8_e4m3``, ``fp8_e5m2``) only on x86 with AVX-512 or AMX
(``vllm/v1/attention/backends/cpu_attn.py:_get_attn_isa`` raises ``NotImplementedError``
otherwise, and the AVX2 build of its kernels, ``vllm._C``, has no fp8 path). A test of the fp8
cache (marked ``fp8_kv``) on a CPU without either cannot run; it is skipped with a reason that
starts with :data:`HARDWARE`, which ``tests/conftest.py`` reports apart from other skips and
does not count as a failure under ``CI=true`` (every other skip is: it means a tool is
missing).

The answer is vLLM's own rule, asked of vLLM (``tests/vllm/test_cpu_view.py`` pins that the
rule and the CPU's flags agree), so a vLLM that widens its fp8 support widens the tests too.
"""

from __future__ import annotations

from functools import cache

import pytest

# The prefix of a skip reason that names hardware this machine lacks (tests/conftest.py).
HARDWARE = "hardware:"


@cache
def fp8_kv_cache_runs() -> bool:
    """Whether vLLM's CPU attention accepts an fp8 KV cache on this CPU (head size 64, the
    suite's models; block size 32)."""
    import torch
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    try:
        _get_attn_isa(torch.float32, 32, 64, "fp8")
    except NotImplementedError:
        return False
    return True


FP8_KV_REASON = (f"{HARDWARE} vLLM's CPU attention holds an fp8 KV cache only on x86 with "
                 "AVX-512 or AMX, and this CPU has neither")


def skip_without_hardware(item: pytest.Item) -> None:
    """Skip ``item`` (as hardware) where it is marked ``fp8_kv`` and vLLM's CPU backend cannot
    hold an fp8 KV cache here. Asked at set-up, so collecting the suite imports no vLLM."""
    if item.get_closest_marker("fp8_kv") is not None and not fp8_kv_cache_runs():
        pytest.skip(FP8_KV_REASON)


def describe() -> str:
    """This CPU in a few words for the suite's record and last line: its model name and the
    vector extensions vLLM's CPU backend chooses its kernels by (a CI machine may lack them,
    and then the fp8 tests do not run and every forward pass is slower)."""
    import platform

    name, flags = platform.processor() or platform.machine(), set()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name") and ":" in line:
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and ":" in line:
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    isa = [label for flag, label in (("avx512f", "AVX-512"), ("amx_tile", "AMX")) if flag in flags]
    return f"{name} ({', '.join(isa) or ('AVX2' if 'avx2' in flags else 'no AVX2')})"
