"""The worker's attention seam: what every backend adapter fills, and one step's data flow.

Data flow of one engine step (scheduler in EngineCore, everything else in the worker)::

  OBCacheScheduler.schedule ──SchedulerOutput.obcache_orders──▶ EvictingRunnerMixin.execute_model
        ▲                                                          │ 1. request states (lifecycle)
        │                                                          │ 2. StepPlan: dead blocks per
        │                                                          │    row, budgeted rows, orders
        │                                                          ▼    checked against its state
        │                                  builder.obcache_plan = plan (set around the build)
        │                                                          │
        │                       EvictingBuilderMixin.build: adapter.shift_reads(cm, plan)
        │                       (read block table / seq lens skip each row's dead head blocks),
        │                       plan.read_block_table, metadata.obcache_plan = plan
        │                                                          │
        │                 per layer: EvictingImplMixin.forward = backend attention, then
        │                 evict_after_attention(plan, ..., adapter.kv_view(kv_cache))
        │                 (remember / buffer queries, score, select, gather -> scatter by block)
        │                                                          │
        │                                                          ▼ 3. commit what every layer
  update_from_output ◀──ModelRunnerOutput.obcache_report── sample_tokens  did; report states,
  (free dead blocks in vLLM's pool; finish a torn request with an error; count faults)  faults

No global or thread-local carries the plan: it rides on the scheduler output, on the builder
for the duration of the build, and on the attention metadata every layer receives.

An adapter (one module per backend in :mod:`obcache_vllm.vllm_ext.worker.backends`) supplies only:

(a) :class:`KvCacheView`: one layer's paged cache as that backend lays it out; gathers a
    request's K/V for its first ``N`` resident slots, and scatters compacted rows back, both by
    block id (whole blocks, never a per-element index of size [Hkv, N, D]);
(b) :meth:`BackendAdapter.shift_reads`: how that backend's read metadata skips dead blocks;
(c) its row of :data:`obcache_vllm.admission.CAPABILITIES`: what it serves, from which
    admission refuses the rest before a request reaches the engine.

Everything else (which queries to keep, when to score, selection, compaction orders, fault
containment) is here and in the runner mixin, and never looks at pipeline names: it asks the
pipeline object (``window``, ``running_mode``, ``scored``).

Fault containment (see :class:`~obcache_vllm.eviction.step.RowOutcome`): an exception while
one row is scored or compacted in one layer is caught here, recorded on the row, and the row is
skipped by the remaining layers. The runner then decides: nothing written -> the request goes
on uncompressed; every layer written -> committed; some layers written -> the cache is torn,
and the scheduler finishes that request alone with an error.

Glossary: ``n`` queries of a request in this step, ``N`` resident tokens, ``K`` kept per head,
``Hq``/``Hkv`` heads, ``D`` head dim, ``bs`` block size.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch
from vllm.v1.attention.backend import AttentionType

from obcache_vllm.eviction.layer import KvCacheView, evict_after_attention
from obcache_vllm.eviction.step import StepPlan
from obcache_vllm.scoring import HeadGeometry


class BackendAdapter(ABC):
    """What one attention backend contributes to eviction (see the module docstring)."""

    name: ClassVar[str]

    @abstractmethod
    def kv_view(self, kv_cache: torch.Tensor, layer: Any, impl: Any) -> KvCacheView:
        """(a) The view of ``layer``'s cache tensor (as the backend's ``forward`` receives it)."""

    @abstractmethod
    def shift_reads(self, common_attn_metadata: Any, plan: StepPlan) -> Any:
        """(b) Read metadata in which row ``r`` starts at block ``plan.dead[r]`` and holds
        ``seq_len - dead*bs`` tokens; the write side (slot mapping, positions) stays logical.

        Returns the ``CommonAttentionMetadata`` the backend's builder is given."""

    # (d) Per-head memory (optional; see :mod:`obcache_vllm.eviction.heads`), declared in the
    # adapter's capabilities: an adapter without it never sees such a row (admission refuses
    # those pipelines).
    per_head_memory: ClassVar[bool] = False

    def head_reads(self, common_attn_metadata: Any, plan: StepPlan, num_kv_heads: int) -> Any:
        """The step's per-head read tables (rows in ``plan.head_layouts``), from the shifted
        read metadata; handed to :meth:`attend_per_head` on the attention metadata."""
        raise NotImplementedError(f"{self.name} has no per-head memory")

    def attend_per_head(self, impl, layer, query, kv_cache, metadata, output) -> None:
        """This layer's attention of the whole batch over per-head tables, into ``output``."""
        raise NotImplementedError(f"{self.name} has no per-head memory")


class EvictingBuilderMixin:
    """Metadata builder half: shifted reads and the plan for the layers (put before the
    backend's builder class in the bases). ``obcache_plan`` is set by the model runner around
    each metadata build, and None otherwise (e.g. CUDA-graph capture, profiling)."""

    obcache_adapter: ClassVar[BackendAdapter]
    obcache_plan: StepPlan | None = None

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        plan = self.obcache_plan
        if plan is not None:
            if plan.shifts_reads:
                common_attn_metadata = self.obcache_adapter.shift_reads(common_attn_metadata, plan)
            plan.read_block_table = common_attn_metadata.block_table_tensor
        metadata = super().build(common_prefix_len, common_attn_metadata, fast_build)
        metadata.obcache_plan = plan if plan is not None and plan.rows else None
        metadata.obcache_heads = None
        if plan is not None and plan.head_layouts:  # some rows' heads own their memory
            metadata.obcache_heads = self.obcache_adapter.head_reads(
                common_attn_metadata, plan, self.kv_cache_spec.num_kv_heads
            )
        return metadata


class EvictingImplMixin:
    """Attention impl half: the backend's attention, then the eviction work of this layer."""

    obcache_adapter: ClassVar[BackendAdapter]
    _obcache_geometry: HeadGeometry | None = None

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kw):
        quantized = any(x is not None for x in (*args, *kw.values()))  # fused output scales
        if getattr(attn_metadata, "obcache_heads", None) is not None and not quantized:
            # Rows whose heads own their memory: the whole batch reads per head (stock rows
            # read each head from their one table, the same tokens as the stock call).
            self.obcache_adapter.attend_per_head(self, layer, query, kv_cache, attn_metadata,
                                                 output)  # fmt: skip
            result = output
        else:
            result = super().forward(
                layer, query, key, value, kv_cache, attn_metadata, output, *args, **kw
            )
        plan = getattr(attn_metadata, "obcache_plan", None)
        if plan is not None and self.attn_type == AttentionType.DECODER:
            view = self.obcache_adapter.kv_view(kv_cache, layer, self)
            evict_after_attention(plan, layer.layer_name, query, view, self.obcache_geometry)
        return result

    @property
    def obcache_geometry(self) -> HeadGeometry:
        if self._obcache_geometry is None:
            self._obcache_geometry = HeadGeometry(
                num_q_heads=self.num_heads,
                num_kv_heads=self.num_kv_heads,
                head_dim=self.head_size,
                scale=self.scale,
            )
        return self._obcache_geometry
