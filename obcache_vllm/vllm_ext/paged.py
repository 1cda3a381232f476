"""Read and write single tokens of vLLM's paged CPU KV cache, whatever its ISA layout.

The CPU attention cache of one layer is ``[num_blocks, Hkv, bs, 2*D]``; each ``(block, head)``
slab holds the keys of its ``bs`` slots, then their values, in an ISA-specific permutation
(``vec``: K column-major ``[D, bs]``, V row-major ``[bs, D]``; ``amx`` packs K for VNNI; ...).
Instead of hard-coding any of them, :func:`probe_layout` writes known values through vLLM's
own ``cpu_attn_reshape_and_cache`` into a scratch slab and reads back where each ``(slot, dim)``
landed. The result, two index maps, turns any token of any block into flat offsets.

Glossary: ``N`` tokens of one request, ``Hkv`` KV heads, ``D`` head dim, ``bs`` block size.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PagedLayout:
    """Flat offsets, inside one ``(block, head)`` slab of ``2*bs*D`` elements, of K and V."""

    block_size: int
    head_dim: int
    k_offsets: torch.Tensor  # [bs, D] int64, in [0, 2*bs*D)
    v_offsets: torch.Tensor  # [bs, D] int64


@functools.lru_cache(maxsize=16)
def probe_layout(isa: str, dtype: torch.dtype, block_size: int, head_dim: int) -> PagedLayout:
    """Learn the slab permutation of ``isa`` by writing markers through vLLM's cache kernel.

    Markers are slot indices and dim indices, written in two passes; they must be exact in
    ``dtype`` (bf16 holds integers up to 256 exactly), so larger blocks or heads are refused.
    """
    from vllm import _custom_ops as ops

    bs, d = block_size, head_dim
    if max(bs, d) > 256:
        raise NotImplementedError(f"layout probe supports bs, D <= 256, got {bs}, {d}")
    slots = torch.arange(bs, dtype=torch.int64)

    def write(marker: torch.Tensor) -> torch.Tensor:
        raw = torch.full((1, 1, bs, 2 * d), -1.0, dtype=dtype)  # one block, one head
        key_cache, value_cache = raw.view(1, 1, 2 * bs, d).chunk(2, dim=2)
        kv = marker.to(dtype).view(bs, 1, d)
        ops.cpu_attn_reshape_and_cache(kv, kv, key_cache, value_cache, slots, isa)
        return raw.reshape(-1).float()

    slot_marker = slots.view(bs, 1).expand(bs, d).float()  # [bs, D]
    dim_marker = torch.arange(d).view(1, d).expand(bs, d).float()  # [bs, D]
    slot_of = write(slot_marker).long()  # [2*bs*D]
    dim_of = write(dim_marker).long()  # [2*bs*D]
    half = bs * d
    offsets = []
    for region in (slice(0, half), slice(half, 2 * half)):
        pos = torch.arange(region.start, region.stop)
        table = torch.full((bs, d), -1, dtype=torch.int64)
        table[slot_of[region], dim_of[region]] = pos
        if (table < 0).any() or table.unique().numel() != half:
            raise RuntimeError(f"KV layout probe for isa={isa!r} is not a permutation")
        offsets.append(table)
    return PagedLayout(bs, d, offsets[0], offsets[1])


def token_offsets(
    layout: PagedLayout, blocks: torch.Tensor, num_tokens: int, num_kv_heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat offsets into ``kv_cache.view(-1)`` of the first ``num_tokens`` tokens of a block row.

    ``blocks`` [>= cdiv(N, bs)] is the (already shifted) block-id row of one request. Returns
    key and value offsets, each ``[Hkv, N, D]``.
    """
    bs, d = layout.block_size, layout.head_dim
    slab = 2 * bs * d
    pos = torch.arange(num_tokens)
    block_ids = blocks[pos // bs].long()  # [N]
    in_block = pos % bs  # [N]
    heads = torch.arange(num_kv_heads).view(-1, 1, 1)  # [Hkv, 1, 1]
    base = (block_ids * num_kv_heads).view(1, -1, 1) + heads  # [Hkv, N, 1] slab index
    base = base * slab
    k = base + layout.k_offsets[in_block].unsqueeze(0)  # [Hkv, N, D]
    v = base + layout.v_offsets[in_block].unsqueeze(0)  # [Hkv, N, D]
    return k, v
