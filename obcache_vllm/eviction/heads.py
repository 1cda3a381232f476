"""Per-head memory: where each KV head's entries live once its heads keep different counts.

A pipeline whose heads own their memory (``adakv``) evicts once, at the compress point, with
the same order as a uniform one (``dead_after`` blocks go, ``K = L - dead_after*bs`` kept per
head on average). Its layout after that order, in the request's block row as the attention reads
it (shifted past the dead blocks)::

    read columns   0 ........ B-1 | B (tail block) | B+1 ... (blocks decode adds)
    every layer:   B*Hkv head-blocks | stock: every head its own part of the block, as vLLM
                   shared out among   | writes it (logical slots); the prompt's last
                   the KV heads       | ``tail = L - B'*bs`` tokens are already there

A *head-block* is one KV head's part of one block (``block * Hkv + head``): in the CPU
backend's ``[num_blocks, Hkv, bs, 2D]`` cache it is contiguous, so the cache viewed as
``[num_blocks * Hkv, 1, bs, 2D]`` has one id per head-block. Head ``h`` of layer ``l`` keeps
``counts[l, h]`` head-blocks, at head-block slots ``offset[l, h] .. offset[l, h] + counts[l, h]``
of the body (slot ``s``: column ``s // Hkv``, head part ``s % Hkv``), ``offset`` the running sum
of the counts before it; then the tail columns, its own head part. ``sum_h counts[l, h] = B *
Hkv`` in every layer, so the blocks a request holds follow the SUM of its heads' kept tokens
(plus the tail block every head shares), as a uniform selection's do, and not the largest head.

New tokens are written by vLLM as for any request (logical slot mapping): only the reads change.
Attention reads each (request, KV head) as one sequence of one KV head over its own table
(:func:`head_tables`), its ``G`` query heads regrouped next to each other (:func:`regroup_index`).

Glossary: R requests of the step, L layers, Hkv KV heads, G query heads per KV head, T query
tokens of the step, M columns of the read block table, W columns of a head table.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class HeadLayout:
    """One request's per-head layout: head-blocks per (layer, KV head) [L, Hkv] before the
    tail block, and ``body_blocks`` B, the blocks they fill (``counts.sum(1) == B * Hkv``)."""

    counts: Tensor
    body_blocks: int

    def __post_init__(self) -> None:
        if self.counts.dim() != 2:
            raise ValueError(f"counts must be [L, Hkv], got {tuple(self.counts.shape)}")
        heads = self.counts.shape[1]
        if not bool((self.counts.sum(dim=1) == self.body_blocks * heads).all()):
            raise ValueError(
                f"every layer's head-blocks must fill {self.body_blocks} blocks of {heads} heads"
            )

    def to_wire(self) -> tuple:
        """``(body_blocks, ((counts of layer 0), ...))``: plain ints, for the scheduler's
        report and a session entry (the next turn's worker starts from it)."""
        return (self.body_blocks, tuple(tuple(row) for row in self.counts.tolist()))

    @classmethod
    def from_wire(cls, value) -> HeadLayout:
        body_blocks, counts = value
        return cls(torch.tensor(counts, dtype=torch.int64), int(body_blocks))


def body_shape(logical_len: int, dead_after: int, block_size: int) -> tuple[int, int]:
    """``(tail, body_blocks)`` of an order at ``logical_len`` that leaves ``dead_after`` dead
    blocks: the prompt tokens in its last block, and the whole blocks between."""
    last = -(-logical_len // block_size) - 1  # the block new tokens go to
    return logical_len - last * block_size, last - dead_after


def head_tables(read_table: Tensor, seq_lens: Tensor, layouts: dict[int, HeadLayout],
                num_layers: int, num_kv_heads: int, block_size: int
                ) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Per layer, a block table and sequence lengths of head-block ids, one row per (request,
    KV head), request-major: ``(ids [L, R*Hkv, W] int32, lens [L, R*Hkv] int32)``.

    ``read_table`` [R, M] and ``seq_lens`` [R] are the step's reads (shifted past each row's
    dead blocks); ``layouts`` maps a row to its per-head layout (rows without one read every
    head from the shared table, as stock). Columns past a row's length hold valid ids that the
    kernel never reads.
    """
    rows, width = read_table.shape
    hkv = num_kv_heads
    table = read_table[:, :width].long()
    lens = seq_lens[:rows].long()
    extra = max([int(lay.counts.max()) - lay.body_blocks for lay in layouts.values()] + [0])
    w = width + max(extra, 0)
    col = torch.arange(w)
    # Stock rows: column j of every layer and head.
    cols = col.clamp(max=width - 1).expand(rows, hkv, w)  # [R, Hkv, W]
    ids = table.gather(1, cols.reshape(rows, -1)).view(rows, hkv, w) * hkv
    ids = ids + torch.arange(hkv).view(1, hkv, 1)
    ids = ids.unsqueeze(0).expand(num_layers, rows, hkv, w).clone()  # [L, R, Hkv, W]
    out_lens = lens.view(1, rows, 1).expand(num_layers, rows, hkv).clone()  # [L, R, Hkv]
    for row, layout in layouts.items():
        counts = layout.counts.long()  # [L, Hkv]
        body = layout.body_blocks
        offset = counts.cumsum(dim=1) - counts  # [L, Hkv]
        in_body = col.view(1, 1, w) < counts.unsqueeze(-1)  # [L, Hkv, W]
        slot = offset.unsqueeze(-1) + col.view(1, 1, w)
        tail_col = body + col.view(1, 1, w) - counts.unsqueeze(-1)
        column = torch.where(in_body, slot // hkv, tail_col).clamp(0, width - 1)
        part = torch.where(in_body, slot % hkv, torch.arange(hkv).view(1, hkv, 1))
        ids[:, row] = table[row][column] * hkv + part
        out_lens[:, row] = counts * block_size + (lens[row] - body * block_size)
    return (ids.view(num_layers, rows * hkv, w).to(torch.int32),
            out_lens.view(num_layers, rows * hkv).to(torch.int32))  # fmt: skip


def regroup_index(query_start_loc: list[int], num_kv_heads: int) -> tuple[Tensor, Tensor]:
    """Where the queries of each (request, KV head) sequence come from, and its starts.

    With ``query.view(T, Hkv, G, D).transpose(0, 1).reshape(Hkv * T, G, D)`` (KV-head major),
    row ``index[i]`` is the i-th query of the regrouped batch (request-major, then KV head, then
    token); ``starts`` [R*Hkv + 1] int32 are the sequences' query start locations.
    """
    total = query_start_loc[-1]
    index, starts = [], [0]
    for r in range(len(query_start_loc) - 1):
        first, last = query_start_loc[r], query_start_loc[r + 1]
        for h in range(num_kv_heads):
            index.append(torch.arange(first, last) + h * total)
            starts.append(starts[-1] + last - first)
    flat = torch.cat(index) if index else torch.zeros(0, dtype=torch.int64)
    return flat, torch.tensor(starts, dtype=torch.int32)


def head_block_slots(counts: list[int], body_blocks: int, first_column: int,
                     block_row: Tensor) -> Tensor:  # fmt: skip
    """Head-block ids [B*Hkv] of one layer's body, head by head in order (head ``h``'s
    ``counts[h]`` follow head ``h-1``'s), from the row's block ids ``block_row`` [M] whose
    column ``first_column`` is the body's first block."""
    hkv = len(counts)
    if sum(counts) != body_blocks * hkv:
        raise ValueError(f"head-blocks {counts} do not fill {body_blocks} blocks")
    slot = torch.arange(body_blocks * hkv)
    blocks = block_row[first_column + slot // hkv].long()
    return blocks * hkv + slot % hkv


def head_residents(counts: list[int], body_blocks: int, num_resident: int,
                   block_size: int) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """Where each KV head's resident entries lie in the row's gathered cache, in order.

    Gathering slots ``[0, N)`` of the row's read block table (shifted past its dead blocks)
    gives ``[Hkv, N, D]`` in which the body's columns hold head-blocks of whichever head owns
    them (body slot ``s``: column ``s // Hkv``, head part ``s % Hkv``) and the columns after
    it each head's own part. Head ``h`` holds ``counts[h] * bs`` body entries (its head-blocks
    in order) then its part of slots ``[B * bs, N)``: ``lengths[h]`` entries in all, in the
    order of their positions (a compaction keeps a head's entries in order).

    Returns ``(index [Hkv, W], lengths [Hkv], in_body [Hkv, W])``: ``index`` points into the
    gathered entries flattened to ``[Hkv * N]``, columns past a head's length at entry 0 (any
    valid one: padding); ``in_body`` marks entries compacted by an earlier order.
    """
    hkv, bs = len(counts), block_size
    stock = num_resident - body_blocks * bs
    if sum(counts) != body_blocks * hkv or stock < 0:
        raise ValueError(f"head-blocks {counts} do not fill {body_blocks} of the row's blocks")
    lengths = torch.tensor([c * bs + stock for c in counts], dtype=torch.int64)
    width = int(lengths.max())
    index = torch.zeros((hkv, width), dtype=torch.int64)
    in_body = torch.zeros((hkv, width), dtype=torch.bool)
    offset = 0
    within = torch.arange(bs)
    for h, count in enumerate(counts):
        slot = torch.arange(offset, offset + count)
        body = ((slot % hkv) * num_resident + (slot // hkv) * bs).view(-1, 1) + within
        own = h * num_resident + torch.arange(body_blocks * bs, num_resident)
        index[h, : lengths[h]] = torch.cat([body.reshape(-1), own])
        in_body[h, : count * bs] = True
        offset += count
    return index, lengths, in_body
