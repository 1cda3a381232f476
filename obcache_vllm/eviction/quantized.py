"""Quantized KV caches (fp8): what a stored byte means, and how vLLM's CPU kernel stores one.

Plain torch. vLLM keeps an fp8 KV cache as ``uint8`` storage (``--kv-cache-dtype fp8``,
``fp8_e4m3``: E4M3 "fn" bytes; ``fp8_e5m2``: E5M2 bytes) and one float scale per layer for keys
and one for values (``layer._k_scale_float``, ``_v_scale_float``; 1.0 unless the checkpoint
ships scales). A stored byte ``b`` means ``float(b as fp8) * scale``.

Eviction never re-quantizes: compaction, copies and the KV oracle move the stored bytes as
they are (a kept token's bytes are bit-identical before and after it moves); only scoring reads
the values, through :func:`dequantize`.

:func:`quantize_like_cpu` is the HF reference's model of the write side. vLLM 0.32's CPU
kernel (``cpu_attn_reshape_and_cache``) was measured to divide by the scale, saturate at the
format's largest finite value and round toward zero (not to nearest):
``tests/vllm/test_cpu_view.py`` checks this against the kernel byte for byte.
"""

from __future__ import annotations

import torch

# vLLM's --kv-cache-dtype values whose bytes are a plain fp8 format with one scale per layer.
FP8_FORMATS: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def is_quantized(cache_dtype: str) -> bool:
    """Whether ``cache_dtype`` (vLLM's ``--kv-cache-dtype``) stores quantized bytes."""
    return str(cache_dtype) not in ("auto", "bfloat16", "float16", "float32", "half", "float")


def fp8_format(cache_dtype: str) -> torch.dtype | None:
    """The fp8 dtype a stored byte is, for the cache dtypes eviction reads; None otherwise."""
    return FP8_FORMATS.get(str(cache_dtype))


def dequantize(stored: torch.Tensor, fmt: torch.dtype, scale: float,
               dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """Values ``float(stored as fmt) * scale`` in ``dtype`` (``stored``: uint8 bytes)."""
    values = stored.view(fmt).to(torch.float32)
    if scale != 1.0:
        values = values * scale
    return values.to(dtype)


def quantize_like_cpu(x: torch.Tensor, fmt: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """The fp8 values vLLM's CPU kernel stores for ``x``: ``x / scale`` saturated to the
    format's range and rounded toward zero; returned dequantized (``* scale``) in x's dtype."""
    finfo = torch.finfo(fmt)
    scaled = (x.to(torch.float32) / scale).clamp(finfo.min, finfo.max)
    nearest = scaled.to(fmt)
    bits = nearest.view(torch.uint8)
    # Round to nearest overshot the magnitude: one code down (magnitude bits are ordered, and
    # a code whose magnitude bits are 0 is a zero, which never overshoots).
    over = nearest.to(torch.float32).abs() > scaled.abs()
    bits = torch.where(over, bits - 1, bits)
    values = bits.view(fmt).to(torch.float32)
    if scale != 1.0:
        values = values * scale
    return values.to(x.dtype)
