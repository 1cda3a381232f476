"""The worker side of eviction: per-request state, the step plan, and the report back.

``OBCacheCPUModelRunner`` replaces ``CPUModelRunner`` in the worker process (the CPU worker
builds its runner by module-global name). Per step:

1. ``execute_model``: update the per-request states from the scheduler output (new requests
   parse their kv_* options; resumed requests restart from scratch; finished ones are dropped).
2. ``_build_attention_metadata``: build the :class:`StepPlan` (dead-block count of every row,
   budgeted rows with their query ranges, the scheduler's orders, checked against the worker's
   own state: a mismatch raises rather than compacting the wrong slots) and publish it to the
   attention metadata builder.
3. After the forward pass, the orders have been applied in every layer: commit the new dead
   counts. ``sample_tokens`` attaches an :class:`EvictionReport` to the ``ModelRunnerOutput``
   (an extra attribute survives the pickle to EngineCore); the scheduler frees only blocks of
   orders listed there.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict

from vllm.v1.worker.cpu_model_runner import CPUModelRunner

from obcache_vllm.options import parse_validated_kv_options
from obcache_vllm.planning import (
    ORDERS_ATTR,
    REPORT_ATTR,
    EvictionOrder,
    EvictionReport,
)
from obcache_vllm.vllm_ext.backend import set_step_plan
from obcache_vllm.vllm_ext.seeded import SeededCpuSamplingMixin
from obcache_vllm.vllm_ext.step import RequestKvState, RowPlan, StepPlan

logger = logging.getLogger(__name__)

RECORD_ENV = "OBCACHE_VLLM_RECORD_KEEP"
_MAX_RECORDS = 256


class EvictionDesyncError(RuntimeError):
    """The scheduler's order does not match the worker's view of the request."""


class OBCacheCPUModelRunner(SeededCpuSamplingMixin, CPUModelRunner):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.obcache_states: dict[str, RequestKvState] = {}
        self._obcache_output = None  # scheduler output of the step being executed
        self._obcache_plan: StepPlan | None = None
        self._obcache_report: EvictionReport | None = None
        # Verification aid: kept indices per request and layer (OBCACHE_VLLM_RECORD_KEEP=1 only).
        self.obcache_records: OrderedDict[str, dict] | None = (
            OrderedDict() if os.environ.get(RECORD_ENV) == "1" else None
        )

    # -- 1. request lifecycle -------------------------------------------------------------
    def _obcache_update_states(self, scheduler_output) -> None:
        for req_id in scheduler_output.finished_req_ids:
            self.obcache_states.pop(req_id, None)
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
            if options is not None:
                state = self.obcache_states[new.req_id] = RequestKvState.create(options)
                if self.obcache_records is not None:
                    state.record = self.obcache_records[new.req_id] = {}
                    while len(self.obcache_records) > _MAX_RECORDS:
                        self.obcache_records.popitem(last=False)
            else:
                self.obcache_states.pop(new.req_id, None)

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        self._obcache_update_states(scheduler_output)
        self._obcache_output = scheduler_output
        try:
            result = super().execute_model(scheduler_output, intermediate_tensors)
        finally:
            self._obcache_output = None
            set_step_plan(None)
        self._obcache_commit()
        return result

    # -- 2. the step plan -----------------------------------------------------------------
    def _build_attention_metadata(self, *args, **kwargs):
        plan = None
        if self._obcache_output is not None and not kwargs.get("for_cudagraph_capture"):
            plan = self._obcache_make_plan(self._obcache_output)
        self._obcache_plan = plan
        set_step_plan(plan)
        try:
            return super()._build_attention_metadata(*args, **kwargs)
        finally:
            set_step_plan(None)

    def _obcache_make_plan(self, scheduler_output) -> StepPlan | None:
        if not self.obcache_states:
            return None
        orders: dict[str, EvictionOrder] = getattr(scheduler_output, ORDERS_ATTR, None) or {}
        batch = self.input_batch
        num_reqs = batch.num_reqs
        qsl = self.query_start_loc.cpu[: num_reqs + 1].tolist()
        computed = batch.num_computed_tokens_cpu[:num_reqs].tolist()
        dead, rows = [], []
        for row, req_id in enumerate(batch.req_ids[:num_reqs]):
            state = self.obcache_states.get(req_id)
            dead.append(state.dead if state is not None else 0)
            if state is None:
                if req_id in orders:
                    raise EvictionDesyncError(f"order for unbudgeted request {req_id}")
                continue
            logical_len = computed[row] + (qsl[row + 1] - qsl[row])
            order = orders.get(req_id)
            if order is not None and (
                order.logical_len != logical_len or order.dead_before != state.dead
            ):
                raise EvictionDesyncError(
                    f"request {req_id}: order {order} vs worker logical_len={logical_len} "
                    f"dead={state.dead}"
                )
            prompt_len = self.requests[req_id].num_prompt_tokens
            rows.append(
                RowPlan(
                    row=row,
                    req_id=req_id,
                    block_size=self.cache_config.block_size,
                    state=state,
                    q_start=qsl[row],
                    q_end=qsl[row + 1],
                    logical_len=logical_len,
                    prompt_len=prompt_len,
                    prefill=computed[row] < prompt_len,
                    order=order,
                )
            )
        missing = set(orders) - {r.req_id for r in rows}
        if missing:
            raise EvictionDesyncError(f"orders for requests not in the batch: {sorted(missing)}")
        return StepPlan(dead=tuple(dead), rows=tuple(rows), block_size=self.cache_config.block_size)

    # -- 3. commit and report -------------------------------------------------------------
    def _obcache_commit(self) -> None:
        plan, self._obcache_plan = self._obcache_plan, None
        if plan is None:
            return
        applied = []
        for row in plan.rows:
            if row.order is None:
                continue
            row.state.dead = row.order.dead_after
            row.state.evictions += 1
            row.state.tokens_evicted += row.order.tokens_evicted
            applied.append(row.req_id)
        if applied:
            self._obcache_report = EvictionReport(
                applied=tuple(applied), seconds=float(sum(plan.timings))
            )

    def sample_tokens(self, grammar_output):
        output = super().sample_tokens(grammar_output)
        report, self._obcache_report = self._obcache_report, None
        if report is not None and output is not None:
            setattr(output, REPORT_ATTR, report)
        return output

