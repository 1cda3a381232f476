"""The CPU adapter's KV view against vLLM's own cache kernel (no engine needed).

Tokens are written into a paged cache by ``cpu_attn_reshape_and_cache`` (the kernel the CPU
backend writes with) at known slots; the view must gather exactly those keys and values, by
block id and batched over requests, and what it scatters must read back through the same
layout. Every ISA the kernel accepts for fp32 here is probed, not assumed.
"""

from __future__ import annotations

import pytest
import torch

from obcache_vllm.vllm_ext.worker.backends.cpu import CpuKvView, probe_layout

BS, D, HKV, BLOCKS = 32, 64, 3, 40


def _write(cache, isa, slots, keys, values):
    from vllm import _custom_ops as ops

    key_cache, value_cache = cache.view(BLOCKS, HKV, 2 * BS, D).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, isa)


@pytest.fixture(params=["vec"])
def isa(request) -> str:
    return request.param


def _rows(num_tokens: int):
    """Three requests, each a scattered block row; their tokens and cache slots."""
    gen = torch.Generator().manual_seed(0)
    perm = torch.randperm(BLOCKS - 1, generator=gen)[:12] + 1  # never the null block 0
    blocks = perm.view(3, 4).to(torch.int32)  # [R, 4]
    keys = torch.randn(3, num_tokens, HKV, D, generator=gen)
    values = torch.randn(3, num_tokens, HKV, D, generator=gen)
    pos = torch.arange(num_tokens)
    slots = (blocks[:, pos // BS].long() * BS + pos % BS)  # [R, N]
    return blocks, keys, values, slots


@pytest.mark.parametrize("num_tokens", [1, 31, 32, 100, 128])
def test_gather_returns_what_the_kernel_wrote(isa, num_tokens):
    cache = torch.zeros(BLOCKS, HKV, BS, 2 * D)
    blocks, keys, values, slots = _rows(num_tokens)
    for r in range(3):
        _write(cache, isa, slots[r], keys[r], values[r])
    view = CpuKvView(cache, probe_layout(isa, torch.float32, BS, D), HKV)
    got_k, got_v = view.gather(blocks, num_tokens)  # [R, Hkv, N, D]
    assert torch.equal(got_k, keys.permute(0, 2, 1, 3))
    assert torch.equal(got_v, values.permute(0, 2, 1, 3))
    one_k, _ = view.gather(blocks[1:2], num_tokens)
    assert torch.equal(one_k[0], keys[1].transpose(0, 1))


def test_scatter_then_gather_round_trips_and_touches_only_its_blocks(isa):
    cache = torch.randn(BLOCKS, HKV, BS, 2 * D)
    before = cache.clone()
    blocks, keys, values, _ = _rows(70)
    view = CpuKvView(cache, probe_layout(isa, torch.float32, BS, D), HKV)
    k, v = keys.permute(0, 2, 1, 3), values.permute(0, 2, 1, 3)  # [R, Hkv, 70, D]
    view.scatter(blocks, k, v)
    got_k, got_v = view.gather(blocks, 70)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    written = set(blocks[:, :3].reshape(-1).tolist())  # cdiv(70, 32) blocks per row
    untouched = [b for b in range(BLOCKS) if b not in written]
    assert torch.equal(cache[untouched], before[untouched])
