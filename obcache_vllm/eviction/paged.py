"""The read shift of a compressed request, on any backend's block table (pure torch).

A compressed row with ``dead`` dead head blocks is read from block-table column ``dead`` on,
with ``seq_len - dead*bs`` tokens (see :mod:`obcache_vllm.eviction.planning` for the layout):
the CPU adapter applies the shift to copies of its tables, the FlashAttention adapter to the
runner's persistent device buffers in place (graph-safe).

Glossary: ``R`` rows of the step, ``M`` block-table width, ``bs`` block size.
"""

from __future__ import annotations

import torch

NULL_BLOCK_ID = 0  # vLLM's null block (block_pool.null_block), never holds live KV


def shift_rows_in_place(
    block_table: torch.Tensor, seq_lens: torch.Tensor, dead: torch.Tensor, block_size: int
) -> None:
    """Row r of (block_table [R, M], seq_lens [R]) skips its first ``dead[r]`` blocks, in place.

    ``dead`` [R] int tensor on the tables' device (0 for untouched rows). Freed columns at the
    end get the null block. Device-side only: no host synchronisation.
    """
    num_rows, width = block_table.shape
    dead = dead[:num_rows].to(block_table.dtype)
    cols = torch.arange(width, device=block_table.device, dtype=block_table.dtype)
    cols = cols.unsqueeze(0) + dead.unsqueeze(1)  # [R, M] source column of each entry
    past_end = cols >= width  # [R, M]
    shifted = torch.gather(block_table, 1, cols.clamp(max=width - 1).long())  # [R, M] new
    shifted.masked_fill_(past_end, NULL_BLOCK_ID)
    block_table.copy_(shifted)
    seq_lens.sub_((dead * block_size).to(seq_lens.dtype))
