"""The worker side of eviction: per-request state, the step plan, the report back (any backend).

:class:`EvictingRunnerMixin` goes before vLLM's model runner in a backend's runner class
(``OBCacheCPUModelRunner(EvictingRunnerMixin, ..., CPUModelRunner)``); it only overrides
methods that the CPU and GPU runners share. Per step:

1. ``execute_model``: update the per-request states from the scheduler output (new requests
   parse their kv_* options; resumed requests restart from scratch; finished ones are dropped).
2. ``_build_attention_metadata``: build the :class:`StepPlan` (dead-block count of every row,
   budgeted rows with their query ranges, the scheduler's orders checked against the worker's
   own state) and hand it to the attention metadata builders for this build only. An order
   that does not match the worker's state is not applied (never raised): it is reported as a
   contained ``desync`` fault and the request is left as it is.
3. After the forward pass: commit what every attention layer did (an order counts as applied
   only if every layer compacted it), and turn the rows' contained faults into the report.
   ``sample_tokens`` attaches the :class:`EvictionReport` to the ``ModelRunnerOutput`` (an extra
   attribute survives the pickle to EngineCore). The report carries each budgeted row's
   cumulative state, so a lost report is made good by the next one.

Tensor parallelism: every rank runs this on its own KV heads with the same plan (the scheduler
output is broadcast); per-head selection keeps the same COUNT on every rank, so one block
table stays valid. A layer ranking shared by the heads (``kv_per_head=false``) is summed over
the TP group (``StepPlan.head_reduce``), and the ranks agree on every row's outcome before
committing (:func:`~obcache_vllm.vllm_ext.step.agree_across_ranks`): only rank 0 reports.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict

from obcache_vllm.options import parse_validated_kv_options
from obcache_vllm.planning import (
    DISABLED_ATTR,
    ORDERS_ATTR,
    REPORT_ATTR,
    EvictionOrder,
    EvictionReport,
    RowFailure,
    RowState,
)
from obcache_vllm.vllm_ext import faults
from obcache_vllm.vllm_ext.core import EvictingBuilderMixin
from obcache_vllm.vllm_ext.step import RequestKvState, RowPlan, StepPlan, agree_across_ranks

logger = logging.getLogger(__name__)

RECORD_ENV = "OBCACHE_VLLM_RECORD_KEEP"
_MAX_RECORDS = 256


class EvictingRunnerMixin:
    """Backend-agnostic worker half of eviction (see the module docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.obcache_states: dict[str, RequestKvState] = {}
        self._obcache_output = None  # scheduler output of the step being executed
        self._obcache_plan: StepPlan | None = None
        self._obcache_report: EvictionReport | None = None
        self._obcache_layer_index: dict[str, int] | None = None
        self._obcache_faults: dict[str, faults.Fault] = {}
        self._obcache_tp_handles = None  # see _obcache_tp
        faults.enabled()  # read the environment once, at start
        # Verification aid: kept indices per request and layer (OBCACHE_VLLM_RECORD_KEEP=1 only).
        self.obcache_records: OrderedDict[str, dict] | None = (
            OrderedDict() if os.environ.get(RECORD_ENV) == "1" else None
        )

    # -- 1. request lifecycle -------------------------------------------------------------
    def _obcache_update_states(self, scheduler_output) -> None:
        for req_id in scheduler_output.finished_req_ids:
            self.obcache_states.pop(req_id, None)
            self._obcache_faults.pop(req_id, None)
        for req_id in getattr(scheduler_output, DISABLED_ATTR, None) or ():
            state = self.obcache_states.get(req_id)
            if state is not None and state.disabled is None:
                state.disabled = "stopped by the scheduler"
                state.drop_scoring_state()
        for req_id in scheduler_output.scheduled_cached_reqs.resumed_req_ids:
            state = self.obcache_states.get(req_id)
            if state is not None:
                state.reset()
        for new in scheduler_output.scheduled_new_reqs:
            params = new.sampling_params
            options = None
            if params is not None and new.prompt_token_ids is not None:
                options = parse_validated_kv_options(
                    params.extra_args, len(new.prompt_token_ids), self.max_model_len
                )
            if options is None:
                self.obcache_states.pop(new.req_id, None)
                continue
            state = self.obcache_states[new.req_id] = RequestKvState.create(options)
            fault = faults.requested(params.extra_args)
            if fault is not None:
                self._obcache_faults[new.req_id] = fault
            if self.obcache_records is not None:
                state.record = self.obcache_records[new.req_id] = {}
                while len(self.obcache_records) > _MAX_RECORDS:
                    self.obcache_records.popitem(last=False)

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        self._obcache_update_states(scheduler_output)
        self._obcache_output = scheduler_output
        try:
            result = super().execute_model(scheduler_output, intermediate_tensors)
        finally:
            self._obcache_output = None
        self._obcache_commit()
        return result

    # -- 2. the step plan -----------------------------------------------------------------
    def _build_attention_metadata(self, *args, **kwargs):
        plan = None
        if self._obcache_output is not None and not kwargs.get("for_cudagraph_capture"):
            plan = self._obcache_make_plan(self._obcache_output)
        self._obcache_plan = plan
        builders = self._obcache_builders()
        for builder in builders:
            builder.obcache_plan = plan
        try:
            return super()._build_attention_metadata(*args, **kwargs)
        finally:
            for builder in builders:
                builder.obcache_plan = None

    def _obcache_builders(self) -> list[EvictingBuilderMixin]:
        return [
            builder
            for groups in self.attn_groups
            for group in groups
            for builder in group.metadata_builders
            if isinstance(builder, EvictingBuilderMixin)
        ]

    @property
    def obcache_layer_index(self) -> dict[str, int]:
        """Attention layer name -> its index, in the order of the (single) KV cache group."""
        if self._obcache_layer_index is None:
            names = self.kv_cache_config.kv_cache_groups[0].layer_names
            self._obcache_layer_index = {name: i for i, name in enumerate(names)}
        return self._obcache_layer_index

    def _obcache_make_plan(self, scheduler_output) -> StepPlan | None:
        if not self.obcache_states:
            return None
        orders: dict[str, EvictionOrder] = getattr(scheduler_output, ORDERS_ATTR, None) or {}
        batch = self.input_batch
        num_reqs = batch.num_reqs
        block_size = self.cache_config.block_size
        qsl = self.query_start_loc.cpu[: num_reqs + 1].tolist()
        computed = batch.num_computed_tokens_cpu[:num_reqs].tolist()
        dead, rows = [], []
        for row, req_id in enumerate(batch.req_ids[:num_reqs]):
            state = self.obcache_states.get(req_id)
            dead.append(state.dead if state is not None else 0)
            if state is None:
                continue
            logical_len = computed[row] + (qsl[row + 1] - qsl[row])
            order, failure = orders.get(req_id), None
            if state.disabled is not None:
                order = None  # a stale order for a request whose eviction stopped
            elif order is not None and (
                order.logical_len != logical_len or order.dead_before != state.dead
            ):
                detail = f"order {order} vs worker logical_len={logical_len} dead={state.dead}"
                order, failure = None, ("schedule", "desync", detail)
            prompt_len = self.requests[req_id].num_prompt_tokens
            plan_row = RowPlan(
                row=row,
                req_id=req_id,
                block_size=block_size,
                state=state,
                q_start=qsl[row],
                q_end=qsl[row + 1],
                logical_len=logical_len,
                prompt_len=prompt_len,
                prefill=computed[row] < prompt_len,
                order=order,
                fault=self._obcache_faults.get(req_id),
            )
            plan_row.outcome.failure = failure
            rows.append(plan_row)
        stray = sorted(set(orders) - {r.req_id for r in rows})
        if stray:  # orders for requests without a worker state: nothing is done for them
            logger.warning("eviction orders for requests the worker does not track: %s", stray)
        return StepPlan(
            dead=tuple(dead),
            rows=tuple(rows),
            block_size=block_size,
            layer_index=self.obcache_layer_index,
            head_reduce=self._obcache_tp()[0],
        )

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

    # -- 3. commit and report -------------------------------------------------------------
    def _obcache_commit(self) -> None:
        plan, self._obcache_plan = self._obcache_plan, None
        if plan is None or not plan.rows:
            return
        num_layers = len(self.obcache_layer_index)
        tp_group = self._obcache_tp()[1]
        if tp_group is not None:  # every rank commits the same outcome (see agree_across_ranks)
            agree_across_ranks(plan.rows, num_layers, tp_group)
        applied, failures, states = [], [], {}
        for row in plan.rows:
            state, order, outcome = row.state, row.order, row.outcome
            compacted = outcome.compacted_layers
            failure = outcome.failure
            if order is not None and failure is None and compacted != num_layers:
                failure = ("compact", "not_applied", f"{compacted} of {num_layers} layers")
            if order is not None and compacted == num_layers:
                state.dead = order.dead_after
                state.evictions += 1
                state.tokens_evicted += order.tokens_evicted
                if state.evictions == 1 and order.logical_len <= row.prompt_len:
                    state.kept_prompt = order.kept + row.prompt_len - order.logical_len
                applied.append(row.req_id)
            if failure is not None:
                torn = 0 < compacted < num_layers
                stage, reason, detail = failure
                failures.append(RowFailure(row.req_id, stage, reason, fatal=torn))
                state.disabled = f"{stage}: {reason}"
                state.drop_scoring_state()
                logger.warning(
                    "obcache: eviction fault for request %s (stage=%s reason=%s): %s; %s",
                    row.req_id, stage, reason, detail,
                    "its cache is torn, it is finished with an error" if torn
                    else "it continues uncompressed",
                )  # fmt: skip
            states[row.req_id] = RowState(
                state.dead, state.evictions, state.tokens_evicted, state.kept_prompt
            )
        report = EvictionReport(
            applied=tuple(applied),
            seconds=float(sum(plan.timings)),
            states=states,
            failures=tuple(failures),
        )
        for row in plan.rows:
            fault = row.fault
            if fault is not None and fault.stage == "report" and row.req_id in applied:
                self._obcache_faults.pop(row.req_id, None)
                report = None  # the injected fault: this step's report is lost
                break
            if fault is not None and row.outcome.failure is not None:
                self._obcache_faults.pop(row.req_id, None)  # one shot
        self._obcache_report = report

    def sample_tokens(self, grammar_output):
        output = super().sample_tokens(grammar_output)
        report, self._obcache_report = self._obcache_report, None
        if report is not None and output is not None:
            setattr(output, REPORT_ATTR, report)
        return output
