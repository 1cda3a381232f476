"""vLLM's V1 model runner bound to the worker half of eviction (any attention backend).

The request lifecycle (states, plan, commit, report, the KV oracle) is
:class:`~obcache_vllm.vllm_ext.worker.lifecycle.WorkerEviction`, which knows no runner. This
module is the V1 binding: :class:`EvictingRunnerMixin` goes before vLLM's model runner in a
backend's runner class (``OBCacheCPUModelRunner(EvictingRunnerMixin, ..., CPUModelRunner)``;
every method it overrides is an ``override`` row of the seam registry) and feeds the lifecycle
what only the V1 runner knows, at the V1 runner's points of a step:

1. ``execute_model``: the step's ``SchedulerOutput`` to :meth:`~.lifecycle.WorkerEviction.
   update_states` (and the runner's way of reading a layer's KV, for the oracle).
2. ``_build_attention_metadata``: the V1 batch (``input_batch``, ``query_start_loc``, the
   requests' prompt lengths) as :class:`~.lifecycle.BatchRows` to :meth:`~.lifecycle.
   WorkerEviction.make_plan`, after the oracle's copy checks; the plan is handed to the
   attention metadata builders for this build only.
3. After the forward pass, :meth:`~.lifecycle.WorkerEviction.commit`; ``sample_tokens``
   attaches the step's :class:`EvictionReport` to the ``ModelRunnerOutput`` (an extra
   attribute survives the pickle to EngineCore).

What a Model Runner V2 port replaces is this module only (see the design note's "Model Runner
V2" section): the three hook points, how the batch and the block tables are read, and how a
layer's KV is reached. The lifecycle, the attention mixins and the scheduler side stay.

Tensor parallelism: every rank runs this on its own KV heads with the same plan (the scheduler
output is broadcast); per-head selection keeps the same COUNT on every rank, so one block
table stays valid. A layer ranking shared by the heads (``kv_per_head=false``) is summed over
the TP group (``StepPlan.head_reduce``), and the ranks agree on every row's outcome before
committing: only rank 0 reports.
"""

from __future__ import annotations

import torch

from obcache_vllm import settings
from obcache_vllm.eviction.messages import EvictionReport
from obcache_vllm.vllm_ext.groups import evicting_group
from obcache_vllm.vllm_ext.wire import REPORT_ATTR
from obcache_vllm.vllm_ext.worker.attention import EvictingBuilderMixin
from obcache_vllm.vllm_ext.worker.lifecycle import BatchRows, WorkerEviction

RECORD_ENV = settings.RECORD_KEEP


class EvictingRunnerMixin:
    """vLLM's V1 runner bound to :class:`WorkerEviction` (see the module docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # Verification aid: kept positions per request and layer (OBCACHE_VLLM_RECORD_KEEP=1).
        self.obcache = WorkerEviction(self.cache_config.block_size,
                                      records=settings.flag(RECORD_ENV),
                                      model=self.model_config.model)  # fmt: skip
        self._obcache_output = None  # scheduler output of the step being executed
        self._obcache_layer_index: dict[str, int] | None = None
        self._obcache_group: int | None = None
        self._obcache_layer_names: list[str] | None = None  # by layer index (the oracle's reads)
        self._obcache_tp_handles = None  # see _obcache_tp

    # -- 1. the step's requests -------------------------------------------------------------
    def execute_model(self, scheduler_output, intermediate_tensors=None):
        self.obcache.update_states(scheduler_output, self._obcache_read_kv,
                                   len(self.obcache_layer_index))  # fmt: skip
        self._obcache_output = scheduler_output
        try:
            result = super().execute_model(scheduler_output, intermediate_tensors)
        finally:
            self._obcache_output = None
        self.obcache.commit(len(self.obcache_layer_index), self._obcache_tp()[1])
        return result

    def _obcache_read_kv(self, layer: int, block_ids, num_tokens: int):
        """Keys and values [Hkv, N, D] of layer ``layer`` over the first ``num_tokens`` slots
        of ``block_ids``, through the backend adapter's view of the layer's cache."""
        if self._obcache_layer_names is None:
            self._obcache_layer_names = list(self.obcache_layer_index)
        module = self.compilation_config.static_forward_context[self._obcache_layer_names[layer]]
        kv_cache = module.kv_cache
        if isinstance(kv_cache, list | tuple):
            kv_cache = kv_cache[0]
        view = module.impl.obcache_adapter.kv_view(kv_cache, module, module.impl)
        ids = torch.tensor([list(block_ids)], dtype=torch.int64, device=kv_cache.device)
        keys, values = view.gather(ids, num_tokens)
        return keys[0].cpu(), values[0].cpu()

    # -- 2. the step plan -----------------------------------------------------------------
    def _build_attention_metadata(self, *args, **kwargs):
        plan = None
        output = self._obcache_output
        if output is not None and not kwargs.get("for_cudagraph_capture"):
            group = self.obcache_group
            tables = {req_id: (state.block_ids[group], state.num_computed_tokens)
                      for req_id, state in self.requests.items()}  # fmt: skip
            self.obcache.check_copies(output, tables, self._obcache_read_kv)
            plan = self.obcache.make_plan(output, self._obcache_batch(), self.obcache_layer_index,
                                          self.device, self._obcache_tp()[0])  # fmt: skip
        builders = self._obcache_builders()
        for builder in builders:
            builder.obcache_plan = plan
        try:
            return super()._build_attention_metadata(*args, **kwargs)
        finally:
            for builder in builders:
                builder.obcache_plan = None

    def _obcache_batch(self) -> BatchRows:
        """The V1 batch of the step being built, as the lifecycle reads it."""
        batch = self.input_batch
        num_reqs = batch.num_reqs
        req_ids = batch.req_ids[:num_reqs]
        return BatchRows(
            req_ids=req_ids,
            query_start_loc=self.query_start_loc.cpu[: num_reqs + 1].tolist(),
            num_computed=batch.num_computed_tokens_cpu[:num_reqs].tolist(),
            prompt_lens={r: self.requests[r].num_prompt_tokens for r in req_ids},
        )

    def _obcache_builders(self) -> list[EvictingBuilderMixin]:
        """The metadata builders of the evicting group's layers (a hybrid model's sliding-
        window groups build stock metadata: no plan, their own block tables)."""
        return [
            builder
            for group in self.attn_groups[self.obcache_group]
            for builder in group.metadata_builders
            if isinstance(builder, EvictingBuilderMixin)
        ]

    @property
    def obcache_group(self) -> int:
        """The KV-cache group budgets evict in (:mod:`obcache_vllm.vllm_ext.groups`; the
        scheduler reads the same layout). A layout without one never gets a budgeted request
        (``StockLayoutScheduler``): group 0 then only names what the oracle would read."""
        if self._obcache_group is None:
            self._obcache_group = evicting_group(self.kv_cache_config).index or 0
        return self._obcache_group

    @property
    def obcache_layer_index(self) -> dict[str, int]:
        """Attention layer name -> its index, in the order of the evicting KV-cache group
        (every layer of a single-group model; a hybrid model's global layers)."""
        if self._obcache_layer_index is None:
            names = self.kv_cache_config.kv_cache_groups[self.obcache_group].layer_names
            self._obcache_layer_index = {name: i for i, name in enumerate(names)}
        return self._obcache_layer_index

    def _obcache_tp(self):
        """(all-reduce of a device tensor, host process group) of the tensor-parallel group,
        or (None, None) on a single rank. vLLM's TP group exists before the runner does."""
        if self._obcache_tp_handles is None:
            from vllm.distributed import (
                get_tensor_model_parallel_world_size,
                get_tp_group,
                tensor_model_parallel_all_reduce,
            )

            if get_tensor_model_parallel_world_size() > 1:
                handles = (tensor_model_parallel_all_reduce, get_tp_group().cpu_group)
            else:
                handles = (None, None)
            self._obcache_tp_handles = handles
        return self._obcache_tp_handles

    # -- 3. the report ----------------------------------------------------------------------
    def sample_tokens(self, grammar_output):
        output = super().sample_tokens(grammar_output)
        report: EvictionReport | None = self.obcache.take_report()
        if report is not None and output is not None:
            setattr(output, REPORT_ATTR, report)
        return output
