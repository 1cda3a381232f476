"""FlashAttention-layout checks: the KV view round trip and the shifted reads, on any device.

Oracles, independent of the code under test:

* reads and writes through explicit per-slot indexing of the logical
  ``[num_blocks, Hkv, bs, 2*D]`` view (what FlashAttention's ``transpose(1, 2).split(D, -1)``
  addresses), not through ``index_select`` / ``index_copy_``;
* :func:`paged_attention_reference`: what FlashAttention computes (varlen queries, ``seqused_k``
  = ``seq_lens``, the block table, bottom-right causal mask), read slot by slot;
* SDPA over the tokens a request must attend to, taken from the tensors that were written
  (per KV head for a compressed request: its kept tokens, then the step's new ones).

Glossary: ``R`` requests, ``n`` queries of one request in the step, ``N`` tokens in its cache
before the step, ``K`` kept per head, ``L`` tokens read, ``Hq``/``Hkv`` heads,
``G = Hq // Hkv``, ``D`` head dim, ``bs`` block size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from obcache_vllm.eviction.paged import shift_rows_in_place
from obcache_vllm.evidence.kernel_checks import Row, at_least, within
from obcache_vllm.scoring import select_keep
from obcache_vllm.vllm_ext.worker.backends.flash_attn_layout import (
    LAYOUT_ORDERS,
    DeadCounts,
    FlashAttnKvView,
    layer_cache_views,
)


def sdpa_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale):
    """q [n, Hq, D]; k, v [Hkv, L, D] (fp32); visible [n, L] bool -> [n, Hq, D]."""
    group = q.shape[1] // k.shape[0]
    k = k.repeat_interleave(group, dim=0)  # [Hq, L, D]  query head h reads KV head h // G
    v = v.repeat_interleave(group, dim=0)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k, v, attn_mask=visible, scale=scale
    )  # [Hq, n, D]
    return out.transpose(0, 1)


def read_slots(kv_cache: torch.Tensor, row: torch.Tensor, num_tokens: int):
    """Keys, values [Hkv, L, D] (fp32) of slots [0, L) of block row ``row``, slot by slot."""
    bs, d = kv_cache.shape[2], kv_cache.shape[3] // 2
    pos = torch.arange(num_tokens, device=kv_cache.device)
    blocks = row.to(kv_cache.device).long()[pos // bs]  # [L]
    kv = kv_cache[blocks, :, pos % bs, :].float()  # [L, Hkv, 2D]
    return kv[..., :d].transpose(0, 1), kv[..., d:].transpose(0, 1)


def write_slots(kv_cache, row, first: int, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Write keys/values [n, Hkv, D] at logical slots [first, first + n) of block row ``row``
    (what vLLM's ``reshape_and_cache_flash`` does through the slot mapping)."""
    bs, d = kv_cache.shape[2], kv_cache.shape[3] // 2
    pos = torch.arange(first, first + keys.shape[0], device=kv_cache.device)
    blocks = row.to(kv_cache.device).long()[pos // bs]  # [n]
    kv_cache[blocks, :, pos % bs, :d] = keys.to(kv_cache.dtype)
    kv_cache[blocks, :, pos % bs, d:] = values.to(kv_cache.dtype)


def paged_attention_reference(query, kv_cache, block_table, seq_lens, query_start_loc, scale):
    """FlashAttention's varlen paged attention in plain torch: query [T, Hq, D] -> [T, Hq, D]
    (fp32). Row r: queries ``query_start_loc[r:r+2]``, keys = slots [0, seq_lens[r]) of
    ``block_table[r]``, query i of n sees slot j iff ``j <= seq_lens[r] - n + i``."""
    out = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
    qsl = query_start_loc.tolist()
    for r, seq_len in enumerate(seq_lens.tolist()):
        lo, hi = qsl[r], qsl[r + 1]
        n = hi - lo
        if n == 0:
            continue
        k, v = read_slots(kv_cache, block_table[r], seq_len)  # [Hkv, L, D]
        i = torch.arange(n, device=query.device).unsqueeze(1)
        j = torch.arange(seq_len, device=query.device).unsqueeze(0)
        visible = j <= seq_len - n + i  # [n, L]
        out[lo:hi] = sdpa_gqa(query[lo:hi].float(), k, v, visible, scale)
    return out


@dataclass(frozen=True)
class Case:
    """One request of the shift scenario: ``dead`` head blocks already compacted away."""

    name: str
    cached: int  # N: logical tokens in the cache before the step
    dead: int  # dead head blocks (0: an uncompressed neighbour)
    new: int  # n: tokens of this step (1 = decode, > 1 = a prefill chunk)


SHIFT_CASES = (
    Case("compressed decode", 100, 3, 1),
    Case("neighbour prefill chunk", 70, 0, 5),
    Case("compressed prefill chunk", 64, 2, 3),
    Case("neighbour decode", 33, 0, 1),
    Case("compressed, all but one block dead", 80, 4, 2),
)


def check_view_round_trip(layout: str, device, dtype=torch.float16, head_dim=32) -> list[Row]:
    """Gather equals per-slot reads; scatter writes exactly its pages, nothing else."""
    gen = torch.Generator(device="cpu").manual_seed(1)
    bs, hkv, layers, num_blocks = 16, 2, 3, 12
    views = layer_cache_views(layers, num_blocks, hkv, bs, head_dim, layout, dtype, device)
    for v in views:
        v.copy_(torch.randn(v.shape, generator=gen).to(dtype))
    before = [v.clone() for v in views]
    view = FlashAttnKvView(views[1], head_dim)
    row = torch.tensor([7, 2, 9, 4, 11], dtype=torch.int32, device=device)
    keys, values = (t[0] for t in view.gather(row[None], 55))  # [Hkv, 55, D]
    ref_k, ref_v = read_slots(views[1], row, 55)
    gather_err = max((keys.float() - ref_k).abs().max(), (values.float() - ref_v).abs().max())
    # FlashAttention's own reading of the same slots: key_cache[block, slot, head].
    key_cache, value_cache = views[1].transpose(1, 2).split(head_dim, dim=-1)
    fa_k = key_cache[row[3].long(), 55 - 3 * bs - 1].float()  # [Hkv, D] slot 54
    fa_err = (fa_k - keys[:, 54].float()).abs().max()

    kept = 37  # scatter into row[1:]: pages 2, 9, 4 (the last one padded from slot 37 % bs)
    new_k = torch.randn((hkv, kept, head_dim), generator=gen).to(dtype).to(device)
    new_v = torch.randn((hkv, kept, head_dim), generator=gen).to(dtype).to(device)
    view.scatter(row[None, 1:], new_k[None], new_v[None])
    got_k, got_v = read_slots(views[1], row[1:], kept)
    scatter_err = max((got_k - new_k.float()).abs().max(), (got_v - new_v.float()).abs().max())
    touched = {2, 9, 4}
    untouched = [b for b in range(num_blocks) if b not in touched]
    others = sum(
        int(not torch.equal(views[i], before[i])) for i in (0, 2)
    ) + int(not torch.equal(views[1][untouched], before[1][untouched]))
    pad = views[1][4, :, kept % bs :].abs().max()  # slots past the kept rows: zeros
    case = f"{layout} {str(dtype).removeprefix('torch.')}"
    return [
        within("view", case, "gather vs per-slot read (max abs)", gather_err, 0.0),
        within("view", case, "gather vs FA key_cache[block, slot]", fa_err, 0.0),
        within("view", case, "scatter then read (max abs)", scatter_err, 0.0),
        within("view", case, "pages/layers changed besides targets", others, 0),
        within("view", case, "padding past the kept rows", pad, 0.0),
    ]


def check_shifted_reads(layout: str, device, dtype=torch.float16, head_dim=64) -> list[Row]:
    """Compact some requests with the view, shift the persistent tables in place, and read
    with :func:`paged_attention_reference`: each request attends exactly to its tokens."""
    gen = torch.Generator(device="cpu").manual_seed(2)
    bs, hkv, hq = 16, 2, 4
    scale = head_dim**-0.5

    def rand(*shape):
        return torch.randn(shape, generator=gen).to(dtype).to(device)

    width = max(-(-(c.cached + c.new) // bs) for c in SHIFT_CASES) + 2  # table width M
    num_blocks = 1 + width * len(SHIFT_CASES)
    (cache, _) = layer_cache_views(2, num_blocks, hkv, bs, head_dim, layout, dtype, device)
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).to(torch.int32)  # no null block
    logical = torch.zeros((len(SHIFT_CASES), width), dtype=torch.int32)  # CPU truth [R, M]
    expected, queries, lens = [], [], []
    view = FlashAttnKvView(cache, head_dim)
    for r, case in enumerate(SHIFT_CASES):
        need = -(-(case.cached + case.new) // bs)
        logical[r, :need] = ids[r * width : r * width + need]
        row = logical[r].to(device)
        k0, v0 = rand(case.cached, hkv, head_dim), rand(case.cached, hkv, head_dim)
        write_slots(cache, row, 0, k0, v0)
        if case.dead:  # compacted at an earlier step: K per head, heads keep different tokens
            count = case.cached - case.dead * bs
            scores = torch.rand((hkv, case.cached), generator=gen).to(device)
            keep = select_keep(scores, keep=count, recent=4, sinks=2)  # [Hkv, K] sorted
            keys, values = (t[0] for t in view.gather(row[None], case.cached))  # [Hkv, N, D]
            index = keep.unsqueeze(-1).expand(-1, -1, head_dim)  # [Hkv, K, D]
            view.scatter(row[None, case.dead :], keys.gather(1, index)[None],
                         values.gather(1, index)[None])  # fmt: skip
            kept_k = k0.transpose(0, 1).float().gather(1, index)  # [Hkv, K, D] from the source
            kept_v = v0.transpose(0, 1).float().gather(1, index)
        else:
            kept_k, kept_v = k0.transpose(0, 1).float(), v0.transpose(0, 1).float()
        k1, v1 = rand(case.new, hkv, head_dim), rand(case.new, hkv, head_dim)
        write_slots(cache, row, case.cached, k1, v1)  # the step's KV, through the LOGICAL table
        q = rand(case.new, hq, head_dim)
        keys = torch.cat([kept_k, k1.transpose(0, 1).float()], dim=1)  # [Hkv, K + n, D]
        values = torch.cat([kept_v, v1.transpose(0, 1).float()], dim=1)
        first = keys.shape[1] - case.new
        visible = torch.arange(keys.shape[1], device=device) <= first + torch.arange(
            case.new, device=device
        ).unsqueeze(1)  # [n, K + n]
        expected.append(sdpa_gqa(q.float(), keys, values, visible, scale))
        queries.append(q)
        lens.append(case.cached + case.new)

    query = torch.cat(queries)  # [T, Hq, D]
    qsl = torch.tensor([0, *torch.tensor([c.new for c in SHIFT_CASES]).cumsum(0).tolist()])
    # The runner's persistent buffers: the device block table and seq_lens of this step.
    table = logical.to(device)  # [R, M]
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)  # [R]
    unshifted = paged_attention_reference(query, cache, table, seq_lens, qsl, scale)
    storage = (table.data_ptr(), seq_lens.data_ptr())
    dead = DeadCounts(device, capacity=2).stage(tuple(c.dead for c in SHIFT_CASES), len(lens))
    shift_rows_in_place(table, seq_lens, dead, bs)
    got = paged_attention_reference(query, cache, table, seq_lens, qsl, scale)

    case_tag = f"{layout} {str(dtype).removeprefix('torch.')}"
    rows = []
    for r, case in enumerate(SHIFT_CASES):
        lo, hi = int(qsl[r]), int(qsl[r + 1])
        err = (got[lo:hi] - expected[r]).abs().max()
        rows.append(within("shift", f"{case_tag} {case.name}", "vs SDPA on its tokens", err, 2e-5))
        if case.dead:  # the negative control: the same cache read without the shift
            stale = (unshifted[lo:hi] - expected[r]).abs().max()
            tag = f"{case_tag} {case.name}"
            rows.append(at_least("shift", tag, "error if read unshifted (control)", stale, 1e-2))
        else:  # neighbours: exactly what they read without any shift
            same = float(not torch.equal(got[lo:hi], unshifted[lo:hi]))
            rows.append(within("shift", f"{case_tag} {case.name}", "changed by the shift", same, 0))
    in_place = float(storage != (table.data_ptr(), seq_lens.data_ptr()))
    rows.append(within("shift", case_tag, "new storage (must stay in place)", in_place, 0))
    table.copy_(logical)  # the next step's commit_block_table: CPU truth -> device
    restored = float(not torch.equal(table.cpu(), logical))
    rows.append(within("shift", case_tag, "differs after re-commit", restored, 0))
    return rows


def run_all(device, dtypes=(torch.float16, torch.bfloat16)) -> list[Row]:
    """Every layout x dtype: the view round trip and the shifted reads."""
    rows: list[Row] = []
    for layout in LAYOUT_ORDERS:
        for dtype in dtypes:
            rows += check_view_round_trip(layout, device, dtype)
            rows += check_shifted_reads(layout, device, dtype)
    return rows
