"""FlashAttention's paged KV cache in vLLM 0.32, in pure torch: the view and the read shift.

No vLLM import (an import-linter contract): this module runs on a bare GPU machine with only
PyTorch (``scripts/gpu_kernels_check.sh``), and the unit tests exercise it on CPU tensors.
:mod:`.flash_attn` binds it to vLLM.

Cache layout (vLLM 0.32, NOT the ``[2, num_blocks, bs, Hkv, D]`` tensor of older vLLM)::

    kv_cache  (one layer, as FlashAttentionImpl.forward / do_kv_cache_update receive it)
      logical shape [num_blocks, Hkv, bs, 2*D]     K = [..., :D], V = [..., D:]
      physical order: one of vLLM's KVCacheLayout stride orders over [L, B, H, N, C]
      (L layers, B blocks, H = Hkv, N = bs slots, C = the 2*D content), e.g.

      LBNHC (FA's default): layer | block | slot | head | K|V     = the old "NHD"
      LBHNC:                layer | block | head | slot | K|V     = the old "HND"
      BLNHC / BLHNC:        block | layer | ...  (one block holds every layer's page)
      LHBNC, BHLNC:         head outside block / layer

    FlashAttention itself reads ``kv_cache.transpose(1, 2).split(D, -1)``: key and value
    caches [num_blocks, bs, Hkv, D] with whatever strides the layout gives.

:class:`FlashAttnKvView` therefore works on the LOGICAL 4-D view only, by block id: whole
pages are selected along dim 0 (``index_select`` / ``index_copy_`` honour any strides), so it
is correct for every layout (``VLLM_KV_CACHE_LAYOUT``), never a per-element index tensor.

Read shift (:func:`~obcache_vllm.eviction.paged.shift_rows_in_place`): FlashAttention reads a
request's KV through its block-table row and ``seqused_k`` (= ``seq_lens``). A compressed row with
``dead`` dead head blocks is read from column ``dead`` on, with ``seq_len - dead*bs`` tokens. vLLM
0.32 hands the builder SLICES of the runner's persistent buffers (``input_batch.block_table[g]
.block_table.gpu`` and ``GPUModelRunner.seq_lens``), rewritten from the logical CPU state at every
step (``commit_block_table`` and ``_prepare_inputs``) after the step's slot mapping was computed
from them; the shift is written into those buffers IN PLACE (a CUDA graph replays exactly these
buffers), and the next step's commit restores the logical values.

Glossary: ``R`` rows (requests) of the step, ``M`` block-table width, ``N`` tokens of one
request, ``K`` kept tokens, ``nb`` blocks, ``Hkv`` KV heads, ``D`` head dim, ``bs`` block size.
"""

from __future__ import annotations

import math

import torch

# vLLM's KVCacheLayout stride orders (vllm/v1/kv_cache_layout.py), over [L, B, H, N, C]:
# physical axis i holds logical axis order[i]. Mirrored here for checks without vLLM; the
# engine-marked tests compare these views with vLLM's own create_kv_cache_views.
LAYOUT_ORDERS: dict[str, tuple[int, ...]] = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
DEFAULT_LAYOUT = "LBNHC"  # vLLM's default preference when FLASH_ATTN declares no layouts


def layer_cache_views(
    num_layers: int,
    num_blocks: int,
    num_kv_heads: int,
    block_size: int,
    head_dim: int,
    layout: str = DEFAULT_LAYOUT,
    dtype: torch.dtype = torch.float16,
    device: torch.device | str = "cpu",
) -> list[torch.Tensor]:
    """One logical [num_blocks, Hkv, bs, 2*D] view per layer over one dense allocation,
    strided like vLLM's ``create_kv_cache_views`` for ``layout`` (one KV cache group)."""
    order = LAYOUT_ORDERS[layout]
    shape = (num_layers, num_blocks, num_kv_heads, block_size, 2 * head_dim)  # [L, B, H, N, C]
    strides = [0] * 5
    step = 1
    for dim in reversed(order):  # innermost physical axis first
        strides[dim] = step
        step *= shape[dim]
    raw = torch.zeros(math.prod(shape), dtype=dtype, device=device)
    view_5d = torch.as_strided(raw, shape, strides)
    return [view_5d[layer] for layer in range(num_layers)]


class FlashAttnKvView:
    """One layer's FlashAttention cache, read and written by block id (KvCacheView).

    ``kv_cache``: the logical [num_blocks, Hkv, bs, 2*D] view (any strides).
    """

    per_head_reads = False  # FlashAttention's call reads one block table for every head

    def __init__(self, kv_cache: torch.Tensor, head_dim: int) -> None:
        if kv_cache.dim() != 4 or kv_cache.shape[-1] != 2 * head_dim:
            raise ValueError(
                f"expected a [num_blocks, Hkv, bs, 2*{head_dim}] cache, got {tuple(kv_cache.shape)}"
            )
        self.kv_cache = kv_cache
        self.head_dim = head_dim
        self.num_kv_heads = kv_cache.shape[1]
        self.block_size = kv_cache.shape[2]

    def gather(self, blocks: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys, values [R, Hkv, N, D] of slots [0, N) of each block row ``blocks`` [R, >=nb]."""
        bs, hkv, d = self.block_size, self.num_kv_heads, self.head_dim
        num_rows, nb = blocks.shape[0], -(-num_tokens // bs)
        ids = blocks[:, :nb].reshape(-1).long()  # [R*nb]
        pages = self.kv_cache.index_select(0, ids)  # [R*nb, Hkv, bs, 2D]
        pages = pages.view(num_rows, nb, hkv, bs, 2 * d).transpose(1, 2)  # [R, Hkv, nb, bs, 2D]
        rows = pages.reshape(num_rows, hkv, nb * bs, 2 * d)[:, :, :num_tokens]  # [R, Hkv, N, 2D]
        return rows[..., :d], rows[..., d:]

    def scatter(self, blocks: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write keys/values [R, Hkv, K, D] into slots [0, K) of each block row (whole pages:
        the slots [K, cdiv(K, bs)*bs) of the last page get zeros; they lie past the request)."""
        bs, hkv, d = self.block_size, self.num_kv_heads, self.head_dim
        num_rows, num_kept = keys.shape[0], keys.shape[2]
        nb = -(-num_kept // bs)
        rows = keys.new_zeros((num_rows, hkv, nb * bs, 2 * d))  # [R, Hkv, nb*bs, 2D]
        rows[:, :, :num_kept, :d] = keys
        rows[:, :, :num_kept, d:] = values
        pages = rows.view(num_rows, hkv, nb, bs, 2 * d).transpose(1, 2)  # [R, nb, Hkv, bs, 2D]
        pages = pages.reshape(num_rows * nb, hkv, bs, 2 * d)
        ids = blocks[:, :nb].reshape(-1).long()
        self.kv_cache.index_copy_(0, ids, pages.to(self.kv_cache.dtype))

    def values_of(self, keys: torch.Tensor, values: torch.Tensor,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """A float cache stores its values (quantized caches are refused for this backend)."""
        return keys.to(dtype), values.to(dtype)

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Whole blocks ``src`` [n] -> ``dst`` [n] (every head, keys and values)."""
        self.kv_cache.index_copy_(0, dst.long(), self.kv_cache.index_select(0, src.long()))


class DeadCounts:
    """Per-row dead-block counts staged for the device: a pinned host buffer copied without
    blocking into a persistent device buffer (vLLM's own CpuGpuBuffer pattern).

    The host buffer is rewritten at the next step's build; by then the copy has completed,
    because the synchronous scheduler's step waits for its sampled tokens (an event after
    everything the step enqueued), as vLLM's own per-step buffers rely on too."""

    def __init__(self, device: torch.device | str, capacity: int = 256) -> None:
        self.device = torch.device(device)
        self._resize(capacity)

    def _resize(self, capacity: int) -> None:
        pin = self.device.type == "cuda"
        self.host = torch.zeros(capacity, dtype=torch.int32, pin_memory=pin)
        self.dev = torch.zeros(capacity, dtype=torch.int32, device=self.device)

    def stage(self, dead: tuple[int, ...], num_rows: int) -> torch.Tensor:
        """[num_rows] int32 on the device: ``dead`` padded with zeros."""
        if num_rows > self.host.shape[0]:
            self._resize(max(num_rows, 2 * self.host.shape[0]))
        host = self.host[:num_rows]
        host.zero_()
        count = min(len(dead), num_rows)
        if count:
            host[:count] = torch.tensor(dead[:count], dtype=torch.int32)
        return self.dev[:num_rows].copy_(host, non_blocking=True)
