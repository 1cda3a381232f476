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
    view = CpuKvView(cache, probe_layout(isa, "auto", torch.float32, BS, D), HKV)
    got_k, got_v = view.gather(blocks, num_tokens)  # [R, Hkv, N, D]
    assert torch.equal(got_k, keys.permute(0, 2, 1, 3))
    assert torch.equal(got_v, values.permute(0, 2, 1, 3))
    one_k, _ = view.gather(blocks[1:2], num_tokens)
    assert torch.equal(one_k[0], keys[1].transpose(0, 1))


def test_scatter_then_gather_round_trips_and_touches_only_its_blocks(isa):
    cache = torch.randn(BLOCKS, HKV, BS, 2 * D)
    before = cache.clone()
    blocks, keys, values, _ = _rows(70)
    view = CpuKvView(cache, probe_layout(isa, "auto", torch.float32, BS, D), HKV)
    k, v = keys.permute(0, 2, 1, 3), values.permute(0, 2, 1, 3)  # [R, Hkv, 70, D]
    view.scatter(blocks, k, v)
    got_k, got_v = view.gather(blocks, 70)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    written = set(blocks[:, :3].reshape(-1).tolist())  # cdiv(70, 32) blocks per row
    untouched = [b for b in range(BLOCKS) if b not in written]
    assert torch.equal(cache[untouched], before[untouched])


# -- fp8 KV caches (--kv-cache-dtype fp8 / fp8_e4m3 / fp8_e5m2): uint8 storage -----------------


@pytest.mark.fp8_kv
@pytest.mark.parametrize("cache_dtype", ["fp8", "fp8_e5m2"])
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.5, 3.0)])
def test_fp8_view_reads_what_the_kernel_stored_and_moves_bytes(cache_dtype, scales):
    """The kernel quantizes (divide by the scale, saturate, round toward zero: the model of
    ``quantize_like_cpu``, checked here element by element); the view's values are what the
    kernel's attention reads; a scatter of gathered bytes writes them back bit for bit."""
    from vllm import _custom_ops as ops

    from obcache_vllm.eviction.quantized import fp8_format, quantize_like_cpu

    fmt = fp8_format(cache_dtype)
    cache = torch.zeros(BLOCKS, HKV, BS, 2 * D, dtype=torch.uint8)
    blocks, keys, values, slots = _rows(70)
    keys = keys * 150  # some beyond e4m3's 448 after scaling: saturation is exercised
    key_cache, value_cache = cache.view(BLOCKS, HKV, 2 * BS, D).chunk(2, dim=2)
    for r in range(3):
        ops.cpu_attn_reshape_and_cache(keys[r], values[r], key_cache, value_cache, slots[r],
                                       "vec", k_scale=scales[0], v_scale=scales[1],
                                       kv_cache_dtype=cache_dtype)  # fmt: skip
    layout = probe_layout("vec", cache_dtype, torch.uint8, BS, D)
    view = CpuKvView(cache, layout, HKV, fp8=fmt, scales=scales)
    stored_k, stored_v = view.gather(blocks, 70)
    assert stored_k.dtype == torch.uint8
    got_k, got_v = view.values_of(stored_k, stored_v, torch.float32)
    want_k = quantize_like_cpu(keys, fmt, scales[0]).permute(0, 2, 1, 3)
    want_v = quantize_like_cpu(values, fmt, scales[1]).permute(0, 2, 1, 3)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    assert (keys.abs() / scales[0] > torch.finfo(fmt).max).any() or fmt == torch.float8_e5m2

    moved = blocks.flip(0)  # every row's bytes into another row's blocks
    before = cache.clone()
    view.scatter(moved, stored_k, stored_v)
    again_k, again_v = view.gather(moved, 70)
    assert torch.equal(again_k, stored_k) and torch.equal(again_v, stored_v)
    untouched = [b for b in range(BLOCKS) if b not in set(moved[:, :3].reshape(-1).tolist())]
    assert torch.equal(cache[untouched], before[untouched])


@pytest.mark.fp8_kv
def test_fp8_layout_probe_matches_the_float_layout_of_the_same_isa():
    """Bit-plane markers find the same permutation the float probe finds (the ``vec`` kernel
    lays fp8 bytes out as it lays floats), and refuse a quantized layout it cannot read."""
    float_layout = probe_layout("vec", "auto", torch.float32, BS, D)
    fp8_layout = probe_layout("vec", "fp8", torch.uint8, BS, D)
    assert torch.equal(float_layout.k_offsets, fp8_layout.k_offsets)
    assert torch.equal(float_layout.v_offsets, fp8_layout.v_offsets)
    with pytest.raises(NotImplementedError, match="fp8_per_token_head"):
        probe_layout("vec", "fp8_per_token_head", torch.uint8, BS, D)


@pytest.mark.fp8_kv
@pytest.mark.parametrize("per_head", [pytest.param(True, id="per-head"), False])
def test_fp8_eviction_selects_on_the_dequantized_cache_and_moves_the_stored_bytes(per_head):
    """``evict_after_attention`` on an fp8 cache the kernel wrote: it keeps exactly what the
    pipeline selects on the dequantized keys and values (not on the bytes, not on the
    unquantized inputs), and the kept tokens' bytes land in their new slots unchanged."""
    from vllm import _custom_ops as ops

    from obcache_vllm.admission import parse_kv_options
    from obcache_vllm.eviction.layer import evict_after_attention
    from obcache_vllm.eviction.messages import EvictionOrder
    from obcache_vllm.eviction.quantized import fp8_format, quantize_like_cpu
    from obcache_vllm.eviction.step import RequestKvState, RowPlan, StepPlan
    from obcache_vllm.scoring import HeadGeometry

    hq, n, budget = 2 * HKV, 200, 70
    geom = HeadGeometry(hq, HKV, D)
    gen = torch.Generator().manual_seed(11)
    cache = torch.zeros(BLOCKS, HKV, BS, 2 * D, dtype=torch.uint8)
    row_blocks = (torch.randperm(BLOCKS - 1, generator=gen)[:8] + 1).to(torch.int32)[None]
    keys, values = torch.randn((2, n, HKV, D), generator=gen)
    pos = torch.arange(n)
    slots = row_blocks[0, pos // BS].long() * BS + pos % BS
    key_cache, value_cache = cache.view(BLOCKS, HKV, 2 * BS, D).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, "vec",
                                   kv_cache_dtype="fp8")  # fmt: skip
    fmt = fp8_format("fp8")
    view = CpuKvView(cache, probe_layout("vec", "fp8", torch.uint8, BS, D), HKV, fp8=fmt)
    stored_k, stored_v = (t[0] for t in view.gather(row_blocks, n))  # [Hkv, N, D] bytes
    query = torch.randn((n, hq, D), generator=gen)

    dead = (n - budget) // BS
    order = EvictionOrder(logical_len=n, dead_before=0, dead_after=dead, block_size=BS)
    options = parse_kv_options({"kv_budget": budget, "kv_pipeline": "snapkv", "kv_window": 8,
                                "kv_per_head": per_head}, n, 4096)  # fmt: skip
    state = RequestKvState.create(options)
    state.record = {}
    row = RowPlan(0, "r0", BS, state, 0, n, n, n, True, order)
    plan = StepPlan(dead=(0,), rows=(row,), block_size=BS)
    plan.read_block_table = row_blocks
    evict_after_attention(plan, "layer", query, view, geom)
    assert row.outcome.failure is None and row.outcome.compacted_layers == 1

    k_deq = quantize_like_cpu(keys, fmt)  # what the cache holds (test above: byte for byte)
    v_deq = quantize_like_cpu(values, fmt)
    q_pos, k_pos = torch.arange(n - 8, n), torch.arange(n)
    scores = state.pipeline.prefill_scores(state.scorer, query[-8:], k_deq, v_deq, geom,
                                           q_pos, k_pos)  # fmt: skip
    want = state.pipeline.select(scores, order.kept, recent=options.recent, sinks=options.sinks)
    keep = state.record["layer"]  # [Hkv, K]
    assert torch.equal(keep, want)
    on_inputs = state.pipeline.prefill_scores(state.scorer, query[-8:], keys, values, geom,
                                              q_pos, k_pos)  # fmt: skip
    assert not torch.equal(on_inputs, scores)  # the check can tell the two apart

    moved_k, moved_v = (t[0] for t in view.gather(row_blocks[:, dead:], order.kept))
    index = keep.unsqueeze(-1).expand(-1, -1, D)
    assert torch.equal(moved_k, torch.gather(stored_k, 1, index))
    assert torch.equal(moved_v, torch.gather(stored_v, 1, index))


def test_the_fp8_hardware_rule_is_vllms_and_matches_this_cpu():
    """The suite skips fp8 tests (as hardware) where ``tests/support/cpu.py`` says vLLM's CPU
    attention refuses an fp8 cache: that answer is vLLM's own ``_get_attn_isa`` rule, which
    today is "x86 with AVX-512 or AMX"; this pins the rule to the CPU's flags, so a vLLM that
    changes it fails here, not as a silent skip or an fp8 engine that does not start."""
    from support.cpu import fp8_kv_cache_runs

    has_isa = torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()
    assert fp8_kv_cache_runs() == has_isa
    if not has_isa:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        with pytest.raises(NotImplementedError, match="AVX-512 or AMX"):
            _get_attn_isa(torch.float32, BS, D, "fp8")
