"""FlashAttention's paged layout (vLLM 0.32) on CPU tensors: the view, the in-place read shift.

Oracles (obcache_vllm.evidence.kernel_checks.paged): per-slot reads of the logical view (FA's own
addressing), a pure-torch paged-attention reference reading the same block table and
seq_lens, and SDPA over exactly the tokens each request must see. The same checks run on CUDA
tensors in scripts/gpu_kernels_check.sh; the equivalence of these views with vLLM's own
create_kv_cache_views is in tests/vllm/test_flash_attn_adapter.py (it imports vLLM).
"""

from __future__ import annotations

import pytest
import torch

from obcache_vllm.eviction.paged import shift_rows_in_place
from obcache_vllm.evidence.kernel_checks import paged
from obcache_vllm.vllm_ext.worker.backends.flash_attn_layout import (
    LAYOUT_ORDERS,
    DeadCounts,
    FlashAttnKvView,
    layer_cache_views,
)

LAYOUTS = [pytest.param(name, id=name) for name in LAYOUT_ORDERS]
DTYPES = [
    pytest.param(torch.float16, id="fp16"),
    pytest.param(torch.bfloat16, id="bf16"),
    pytest.param(torch.float32, id="fp32"),
]


def _failures(rows):
    return [f"{r.case}: {r.metric} = {r.value} (bound {r.bound})" for r in rows if not r.ok]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_view_gathers_and_scatters_whole_pages_by_block_id(layout, dtype):
    rows = paged.check_view_round_trip(layout, "cpu", dtype)
    assert len(rows) == 5 and not _failures(rows)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_shifted_reads_attend_exactly_to_each_requests_tokens(layout, dtype):
    """Compressed rows (dead head blocks, heads keeping different tokens) attend exactly to
    their kept tokens plus the step's new ones; neighbours read exactly what they read
    without the shift; the shift stays in the persistent buffers and a re-commit undoes it;
    the same cache read without the shift is wrong (the check has teeth)."""
    rows = paged.check_shifted_reads(layout, "cpu", dtype)
    assert not _failures(rows)
    controls = [r for r in rows if "control" in r.metric]
    assert len(controls) == sum(1 for c in paged.SHIFT_CASES if c.dead)


def test_views_are_the_permuted_strides_of_one_allocation():
    """LBNHC (FlashAttention's default) is the old NHD: slot-major pages, head inside;
    LBHNC the old HND; BLNHC interleaves the layers' pages inside each block."""
    nhd = layer_cache_views(2, 5, 3, 16, 8, "LBNHC")[1]  # [B=5, H=3, N=16, C=16]
    assert nhd.shape == (5, 3, 16, 16)
    assert nhd.stride() == (16 * 3 * 16, 16, 3 * 16, 1)
    hnd = layer_cache_views(2, 5, 3, 16, 8, "LBHNC")[0]
    assert hnd.is_contiguous()
    blocks_outer = layer_cache_views(2, 5, 3, 16, 8, "BLNHC")
    page = 3 * 16 * 16
    assert blocks_outer[0].stride(0) == 2 * page  # one block holds both layers' pages
    assert blocks_outer[1].storage_offset() == page


def test_shift_rows_in_place_edges():
    table = torch.arange(1, 13, dtype=torch.int32).view(3, 4)  # [R=3, M=4]
    seq_lens = torch.tensor([64, 50, 20], dtype=torch.int32)
    before = table.data_ptr(), seq_lens.data_ptr()
    dead = torch.tensor([4, 1], dtype=torch.int32)  # shorter than R: row 2 untouched
    shift_rows_in_place(table, seq_lens, torch.cat([dead, torch.zeros(1, dtype=torch.int32)]), 16)
    assert table.tolist() == [[0, 0, 0, 0], [6, 7, 8, 0], [9, 10, 11, 12]]
    assert seq_lens.tolist() == [0, 34, 20]
    assert (table.data_ptr(), seq_lens.data_ptr()) == before


def test_dead_counts_pad_with_zeros_and_grow():
    staging = DeadCounts("cpu", capacity=2)
    assert staging.stage((3, 1), 4).tolist() == [3, 1, 0, 0]  # grew past its capacity
    assert staging.stage((2,), 3).tolist() == [2, 0, 0]  # the old counts do not linger
    assert staging.stage((5, 6, 7), 2).tolist() == [5, 6]


def test_view_rejects_a_cache_that_is_not_fa_shaped():
    with pytest.raises(ValueError, match="2\\*64"):
        FlashAttnKvView(torch.zeros(4, 2, 16, 64), head_dim=64)


def test_the_kernel_checks_import_without_vllm():
    """scripts/gpu_kernels_check.sh runs where vLLM is not installed: importing the checks (and
    the packages above flash_attn_layout) must not import it."""
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys, obcache_vllm.evidence.kernel_checks.paged, "
        "obcache_vllm.evidence.kernel_checks.scorers\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'vllm'))"
    )
    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=repo, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_batched_gather_and_scatter_equal_row_by_row():
    """The view moves several requests' rows at once (the core batches decode evictions)."""
    from obcache_vllm.vllm_ext.worker.backends.flash_attn_layout import (
        FlashAttnKvView,
        layer_cache_views,
    )

    gen = torch.Generator().manual_seed(3)
    cache = layer_cache_views(2, 20, 2, 16, 8, "BLNHC", torch.float32)[0]  # a permuted layout
    cache.copy_(torch.randn(cache.shape, generator=gen))
    view = FlashAttnKvView(cache, 8)
    rows = torch.tensor([[3, 9, 1], [7, 2, 15], [11, 4, 6]], dtype=torch.int32)
    keys, values = view.gather(rows, 40)  # [3, Hkv, 40, D]
    for r in range(3):
        k, v = view.gather(rows[r : r + 1], 40)
        assert torch.equal(keys[r], k[0]) and torch.equal(values[r], v[0])
    new_k, new_v = torch.randn(3, 2, 20, 8, generator=gen), torch.randn(3, 2, 20, 8, generator=gen)
    view.scatter(rows[:, 1:], new_k, new_v)
    got_k, got_v = view.gather(rows[:, 1:], 20)
    assert torch.equal(got_k, new_k) and torch.equal(got_v, new_v)
