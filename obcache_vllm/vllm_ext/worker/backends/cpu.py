"""CPU adapter (vLLM's ``CPU_ATTN``): paged layout view, shifted reads, refusals, classes.

Installed by overriding ``AttentionBackendEnum.CPU_ATTN`` (the CPU platform ignores
``--attention-backend``), keeping the backend's name so every other part of vLLM sees CPU_ATTN,
and by rebinding ``cpu_worker.CPUModelRunner`` (the CPU worker builds its runner by that name).

Cache layout: one layer's cache is ``[num_blocks, Hkv, bs, 2*D]``; each ``(block, head)`` slab
holds the keys of its ``bs`` slots, then their values, in an ISA-specific permutation (``vec``:
K column-major ``[D, bs]``, V row-major ``[bs, D]``; ``amx`` packs K for VNNI; ...). Instead of
hard-coding any of them, :func:`probe_layout` writes known values through vLLM's own
``cpu_attn_reshape_and_cache`` into a scratch slab and reads back where each ``(slot, dim)``
landed: two permutations of ``bs*D`` offsets. :class:`CpuKvView` then moves whole slabs by
block id and permutes inside them with those two small index vectors.

Shifted reads: the persistent block table of the CPU runner IS its "device" table (one
tensor), and it drives the next step's slot mapping, so the shift builds NEW tensors.

Glossary: ``N`` tokens of one request, ``nb`` blocks, ``Hkv`` KV heads, ``D`` head dim,
``bs`` block size.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)
from vllm.v1.worker.cpu_model_runner import CPUModelRunner

from obcache_vllm.admission import CAPABILITIES
from obcache_vllm.eviction.heads import head_tables, regroup_index
from obcache_vllm.eviction.paged import shift_rows_in_place
from obcache_vllm.eviction.quantized import dequantize, fp8_format, is_quantized
from obcache_vllm.eviction.step import StepPlan
from obcache_vllm.vllm_ext.worker.attention import (
    BackendAdapter,
    EvictingBuilderMixin,
    EvictingImplMixin,
)
from obcache_vllm.vllm_ext.worker.runner import EvictingRunnerMixin
from obcache_vllm.vllm_ext.worker.seeded import SeededCpuSamplingMixin


@dataclass(frozen=True)
class PagedLayout:
    """Where slot ``s``, dim ``d`` of a ``(block, head)`` slab of ``2*bs*D`` elements lives."""

    block_size: int
    head_dim: int
    k_offsets: torch.Tensor  # [bs*D] int64 in [0, 2*bs*D), slot-major: index s*D + d
    v_offsets: torch.Tensor  # [bs*D] int64


@functools.lru_cache(maxsize=16)
def probe_layout(isa: str, cache_dtype: str, storage: torch.dtype, block_size: int,
                 head_dim: int) -> PagedLayout:  # fmt: skip
    """Learn the slab permutation of ``isa`` for ``cache_dtype`` (vLLM's ``--kv-cache-dtype``,
    stored as ``storage``) by writing markers through vLLM's cache kernel.

    The markers are bit planes: pass ``b`` writes bit ``b`` of each slot's index (then of each
    dim's index) as 0.0 or 1.0, values every storage format holds exactly, fp8 included (whose
    kernel path quantizes and may lay bytes out differently). A position the kernel did not
    write keeps a sentinel that is neither.
    """
    from vllm import _custom_ops as ops

    bs, d = block_size, head_dim
    fmt = fp8_format(cache_dtype)
    if fmt is None and is_quantized(cache_dtype):
        raise NotImplementedError(f"no KV view for kv_cache_dtype={cache_dtype!r}")
    slots = torch.arange(bs, dtype=torch.int64)

    def write(marker: torch.Tensor) -> torch.Tensor:
        """Marker [bs, D] of 0/1 values -> what each of the slab's 2*bs*D elements holds."""
        raw = torch.empty((1, 1, bs, 2 * d), dtype=storage)  # one block, one head
        if fmt is None:
            raw.fill_(-1.0)
        else:
            raw.view(fmt).fill_(float("nan"))
        key_cache, value_cache = raw.view(1, 1, 2 * bs, d).chunk(2, dim=2)
        # Inputs in the storage dtype (a float cache), or fp32 for a quantized one (the kernel
        # quantizes any float input; the layout is the ISA's, not the input's).
        kv = marker.to(storage if fmt is None else torch.float32).view(bs, 1, d)
        ops.cpu_attn_reshape_and_cache(kv, kv, key_cache, value_cache, slots, isa,
                                       kv_cache_dtype=cache_dtype)  # fmt: skip
        flat = raw.reshape(-1)
        return (flat if fmt is None else flat.view(fmt)).to(torch.float32)

    def index_of(size: int, along: int) -> torch.Tensor:
        """For each slab element, the slot (along=0) or dim (along=1) index written there."""
        index = torch.zeros(2 * bs * d, dtype=torch.int64)
        for bit in range(max(1, (size - 1).bit_length())):
            ids = torch.arange(size).view(-1, 1) if along == 0 else torch.arange(size).view(1, -1)
            plane = write(((ids >> bit) & 1).expand(bs, d))
            if not ((plane == 0) | (plane == 1)).all():
                raise RuntimeError(f"KV layout probe for isa={isa!r}: unwritten positions")
            index |= plane.long() << bit
        return index

    slot_of, dim_of = index_of(bs, 0), index_of(d, 1)  # [2*bs*D] each
    half = bs * d
    offsets = []
    for region in (slice(0, half), slice(half, 2 * half)):
        pos = torch.arange(region.start, region.stop)
        table = torch.full((bs, d), -1, dtype=torch.int64)
        table[slot_of[region], dim_of[region]] = pos
        if (table < 0).any() or table.unique().numel() != half:
            raise RuntimeError(f"KV layout probe for isa={isa!r} is not a permutation")
        offsets.append(table.reshape(-1))
    return PagedLayout(bs, d, offsets[0], offsets[1])


class CpuKvView:
    """One layer's CPU paged cache, read and written by block id (see the module docstring)."""

    def __init__(self, kv_cache: torch.Tensor, layout: PagedLayout, num_kv_heads: int,
                 per_head_reads: bool = True, fp8: torch.dtype | None = None,
                 scales: tuple[float, float] = (1.0, 1.0)) -> None:  # fmt: skip
        # Whether this layer can read per head (:func:`attend_per_head`: no ALiBi slopes or
        # attention sinks, which are per query head for the whole batch).
        self.per_head_reads = per_head_reads
        # An fp8 cache: the format its bytes are and the layer's (key, value) scales.
        self.fp8 = fp8
        self.scales = scales
        self.block_size = layout.block_size
        self.layout = layout
        self.num_kv_heads = num_kv_heads
        self.slabs = kv_cache.view(-1, num_kv_heads, 2 * layout.block_size * layout.head_dim)

    def gather(self, blocks: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        bs, d, hkv = self.block_size, self.layout.head_dim, self.num_kv_heads
        rows, nb = blocks.shape[0], -(-num_tokens // bs)
        ids = blocks[:, :nb].reshape(-1).long()  # [R*nb]
        slabs = self.slabs.index_select(0, ids)  # [R*nb, Hkv, 2*bs*D]

        def unpack(offsets: torch.Tensor) -> torch.Tensor:
            # gather with a broadcast (stride-0) index: one small index vector, no [.., N, D]
            # index tensor, and ~10x faster than index_select on the last dim here.
            flat = torch.gather(slabs, 2, offsets.expand(rows * nb, hkv, -1))  # [R*nb, Hkv, bs*D]
            per_head = flat.view(rows, nb, hkv, bs, d).permute(0, 2, 1, 3, 4)  # [R, Hkv, nb, bs, D]
            return per_head.reshape(rows, hkv, nb * bs, d)[:, :, :num_tokens]  # [R, Hkv, N, D]

        return unpack(self.layout.k_offsets), unpack(self.layout.v_offsets)

    def scatter(self, blocks: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        bs, d, hkv = self.block_size, self.layout.head_dim, self.num_kv_heads
        rows, num_tokens = keys.shape[0], keys.shape[2]
        nb = -(-num_tokens // bs)
        slabs = self.slabs.new_zeros((rows * nb, hkv, 2 * bs * d))  # [R*nb, Hkv, 2*bs*D]
        for part, offsets in ((keys, self.layout.k_offsets), (values, self.layout.v_offsets)):
            padded = part.new_zeros((rows, hkv, nb * bs, d))  # [R, Hkv, nb*bs, D]
            padded[:, :, :num_tokens] = part
            slot_major = padded.view(rows, hkv, nb, bs * d).transpose(1, 2)  # [R, nb, Hkv, bs*D]
            slabs.scatter_(2, offsets.expand(rows * nb, hkv, -1),
                           slot_major.reshape(rows * nb, hkv, bs * d))  # fmt: skip
        self.slabs.index_copy_(0, blocks[:, :nb].reshape(-1).long(), slabs)

    def values_of(self, keys: torch.Tensor, values: torch.Tensor,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """What gathered ``keys``/``values`` mean, in ``dtype``: themselves for a float cache,
        the fp8 bytes times the layer's scales for a quantized one (as the kernel reads them)."""
        if self.fp8 is None:
            return keys.to(dtype), values.to(dtype)
        k_scale, v_scale = self.scales
        return (dequantize(keys, self.fp8, k_scale, dtype),
                dequantize(values, self.fp8, v_scale, dtype))  # fmt: skip

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Whole blocks ``src`` [n] -> ``dst`` [n] (every head, keys and values)."""
        self.slabs.index_copy_(0, dst.long(), self.slabs.index_select(0, src.long()))

    def scatter_head_blocks(self, ids: torch.Tensor, keys: torch.Tensor,
                            values: torch.Tensor) -> None:  # fmt: skip
        """Keys/values [n, bs, D] into head-blocks ``ids`` [n]: slab ``(block, head)`` of the
        cache is row ``block * Hkv + head`` of its ``[num_blocks * Hkv, 2*bs*D]`` view."""
        bs, d = self.block_size, self.layout.head_dim
        count = ids.shape[0]
        flat = self.slabs.view(-1, 2 * bs * d)
        slab = flat.new_empty((count, 2 * bs * d))
        slab.scatter_(1, self.layout.k_offsets.expand(count, -1), keys.reshape(count, bs * d))
        slab.scatter_(1, self.layout.v_offsets.expand(count, -1), values.reshape(count, bs * d))
        flat.index_copy_(0, ids.long(), slab)


@dataclass
class HeadReads:
    """One step's per-head reads (rows whose heads own their memory, see
    :mod:`obcache_vllm.eviction.heads`): per layer index a table and lengths of head-block
    ids, one row per (request, KV head); how queries are regrouped into those rows."""

    layer_index: dict[str, int]
    ids: torch.Tensor  # [L, R*Hkv, W] int32
    lens: torch.Tensor  # [L, R*Hkv] int32
    index: torch.Tensor  # [Hkv*T] int64: regrouped query i is row index[i] of the head-major view
    starts: torch.Tensor  # [R*Hkv + 1] int32


def attend_per_head(impl, layer, query, kv_cache, metadata, output) -> None:
    """The CPU kernel over per-head sequences: each (request, KV head) attends its own
    head-blocks with its G query heads (``cpu_attention_with_kv_cache`` on the cache viewed as
    one KV head per block; the same call as stock, on ``R*Hkv`` sequences)."""
    from vllm import _custom_ops as ops
    from vllm import envs

    if impl.alibi_slopes is not None or impl.sinks is not None:
        raise NotImplementedError("per-head memory with ALiBi or attention sinks")
    reads: HeadReads = metadata.obcache_heads
    layer_id = reads.layer_index[layer.layer_name]
    tokens = metadata.num_actual_tokens
    hkv, d = impl.num_kv_heads, impl.head_size
    group = impl.num_heads // hkv
    q = query[:tokens].reshape(tokens, hkv, group, d).transpose(0, 1)  # [Hkv, T, G, D]
    q = q.reshape(hkv * tokens, group, d).index_select(0, reads.index)
    num_blocks, _, bs, _ = kv_cache.shape
    key_cache, value_cache = kv_cache.view(num_blocks * hkv, 1, 2 * bs, d).chunk(2, dim=2)
    lens = reads.lens[layer_id]
    scheduler_metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=lens.shape[0], num_heads=group, num_kv_heads=1, head_dim=d, seq_lens=lens,
        dtype=q.dtype, query_start_loc=reads.starts, causal=metadata.causal,
        sliding_window_size=-1, isa=layer.isa, enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
        kv_cache_dtype=impl.kv_cache_dtype,
    )  # fmt: skip
    out = torch.empty_like(q)
    ops.cpu_attention_with_kv_cache(
        query=q, key_cache=key_cache, value_cache=value_cache, output=out,
        query_start_loc=reads.starts, seq_lens=lens, scale=impl.scale, causal=metadata.causal,
        alibi_slopes=None, sliding_window=impl.sliding_window, block_table=reads.ids[layer_id],
        softcap=impl.logits_soft_cap, scheduler_metadata=scheduler_metadata, s_aux=None,
        k_scale=layer._k_scale_float, v_scale=layer._v_scale_float,
        kv_cache_dtype=impl.kv_cache_dtype,
    )  # fmt: skip
    grouped = torch.empty_like(out).index_copy_(0, reads.index, out)  # [Hkv*T, G, D]
    result = grouped.view(hkv, tokens, group, d).transpose(0, 1)  # [T, Hkv, G, D]
    output[:tokens].view(tokens, hkv, group, d).copy_(result)


def shift_block_table(
    table: torch.Tensor, seq_lens: torch.Tensor, dead: tuple[int, ...], block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """New (block table [R, M], seq_lens [R]) in which row r skips its first ``dead[r]`` blocks
    (null block 0 fills the freed columns at the end): FLASH_ATTN's in-place shift on copies,
    since the CPU backend's metadata is rebuilt every step and nothing replays the buffers."""
    table, seq_lens = table.clone(), seq_lens.clone()
    dead_t = torch.zeros(table.shape[0], dtype=torch.int64)
    dead_t[: len(dead)] = torch.tensor(dead, dtype=torch.int64)
    shift_rows_in_place(table, seq_lens, dead_t, block_size)
    return table, seq_lens


class CpuAdapter(BackendAdapter):
    name = CAPABILITIES["cpu"].adapter
    per_head_memory = CAPABILITIES["cpu"].per_head_memory

    def kv_view(self, kv_cache, layer, impl) -> CpuKvView:
        cache_dtype = str(impl.kv_cache_dtype)
        layout = probe_layout(layer.isa, cache_dtype, kv_cache.dtype, kv_cache.shape[2],
                              impl.head_size)  # fmt: skip
        plain = impl.alibi_slopes is None and impl.sinks is None
        scales = (float(layer._k_scale_float), float(layer._v_scale_float))
        return CpuKvView(kv_cache, layout, impl.num_kv_heads, per_head_reads=plain,
                         fp8=fp8_format(cache_dtype), scales=scales)  # fmt: skip

    def shift_reads(self, common_attn_metadata, plan: StepPlan):
        cm = common_attn_metadata
        table, seq_lens = shift_block_table(
            cm.block_table_tensor, cm.seq_lens, plan.dead, plan.block_size
        )
        num_reqs = table.shape[0]
        return dataclasses.replace(
            cm,
            block_table_tensor=table,
            seq_lens=seq_lens,
            max_seq_len=int(seq_lens.max().item()) if num_reqs else 0,
        )

    def head_reads(self, common_attn_metadata, plan: StepPlan, num_kv_heads: int) -> HeadReads:
        cm = common_attn_metadata
        rows = cm.num_reqs  # the tables may carry padding rows; the regrouped batch does not
        ids, lens = head_tables(cm.block_table_tensor[:rows], cm.seq_lens[:rows],
                                plan.head_layouts, len(plan.layer_index), num_kv_heads,
                                plan.block_size)  # fmt: skip
        qsl = cm.query_start_loc_cpu[: rows + 1].tolist()
        index, starts = regroup_index(qsl, num_kv_heads)
        return HeadReads(dict(plan.layer_index), ids, lens, index, starts)

    def attend_per_head(self, impl, layer, query, kv_cache, metadata, output) -> None:
        attend_per_head(impl, layer, query, kv_cache, metadata, output)


ADAPTER = CpuAdapter()


class OBCacheMetadataBuilder(EvictingBuilderMixin, CPUAttentionMetadataBuilder):
    obcache_adapter = ADAPTER


class OBCacheCPUImpl(EvictingImplMixin, CPUAttentionBackendImpl):
    obcache_adapter = ADAPTER


class OBCacheCPUBackend(CPUAttentionBackend):
    """CPU_ATTN with OBCache eviction (same name: the rest of vLLM must not notice)."""

    @staticmethod
    def get_impl_cls():
        return OBCacheCPUImpl

    @staticmethod
    def get_builder_cls():
        return OBCacheMetadataBuilder


class OBCacheCPUModelRunner(EvictingRunnerMixin, SeededCpuSamplingMixin, CPUModelRunner):
    """vLLM's CPU model runner with the worker half of eviction, and seeded sampling that
    survives chunked prefill (:mod:`obcache_vllm.vllm_ext.worker.seeded`)."""
