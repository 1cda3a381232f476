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
KV oracle (verification mode, :mod:`obcache_vllm.eviction.oracle`): when the scheduler output
carries a ``VerifyNote``, what each new entry's donor left is fingerprinted in step 1 (before
vLLM runs the step's block copies), and the entries, the adopters and the copies themselves
are checked in step 2 (after the copies, before the forward pass); mismatches ride on the
report.

3. After the forward pass: commit what every attention layer did (an order counts as applied
   only if every layer compacted it), and turn the rows' contained faults into the report.
   ``sample_tokens`` attaches the :class:`EvictionReport` to the ``ModelRunnerOutput`` (an extra
   attribute survives the pickle to EngineCore). The report carries each budgeted row's
   cumulative state, so a lost report is made good by the next one.

Tensor parallelism: every rank runs this on its own KV heads with the same plan (the scheduler
output is broadcast); per-head selection keeps the same COUNT on every rank, so one block
table stays valid. A layer ranking shared by the heads (``kv_per_head=false``) is summed over
the TP group (``StepPlan.head_reduce``), and the ranks agree on every row's outcome before
committing (:func:`~obcache_vllm.eviction.step.agree_across_ranks`): only rank 0 reports.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections import OrderedDict

import torch

from obcache_vllm.eviction.messages import EvictionOrder, EvictionReport, RowFailure, RowState
from obcache_vllm.eviction.oracle import KvOracle
from obcache_vllm.eviction.step import (
    DecodeQueryStore,
    RequestKvState,
    RowGroup,
    RowPlan,
    StepPlan,
    agree_across_ranks,
)
from obcache_vllm.options import WireError, admitted_options
from obcache_vllm.vllm_ext.wire import (
    DISABLED_ATTR,
    ORDERS_ATTR,
    REPORT_ATTR,
    STARTS_ATTR,
    VERIFY_ATTR,
)
from obcache_vllm.vllm_ext.worker.attention import EvictingBuilderMixin

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
        self.obcache_queries = DecodeQueryStore()
        self._obcache_untracked: list[str] = []
        self._obcache_tp_handles = None  # see _obcache_tp
        self._obcache_oracle: KvOracle | None = None  # created by the first VerifyNote
        self._obcache_verify = None  # the step's VerifyNote until its checks have run
        self._obcache_mismatches: list = []
        self._obcache_layer_names: list[str] | None = None  # by layer index (the oracle's reads)
        # Verification aid: kept indices per request and layer (OBCACHE_VLLM_RECORD_KEEP=1 only).
        self.obcache_records: OrderedDict[str, dict] | None = (
            OrderedDict() if os.environ.get(RECORD_ENV) == "1" else None
        )

    # -- 1. request lifecycle -------------------------------------------------------------
    def _obcache_update_states(self, scheduler_output) -> None:
        for req_id in scheduler_output.finished_req_ids:
            self._obcache_drop(req_id)
        for req_id in getattr(scheduler_output, DISABLED_ATTR, None) or ():
            state = self.obcache_states.get(req_id)
            if state is not None and state.disabled is None:
                self._obcache_disable(state, "stopped by the scheduler")
        for req_id in scheduler_output.scheduled_cached_reqs.resumed_req_ids:
            state = self.obcache_states.get(req_id)
            if state is not None:
                state.reset()
                if state.options.when == "pressure":  # recomputed: stock again until short
                    state.pressure_pending = True
                    if state.decode_slot is not None:
                        self.obcache_queries.release(state.decode_slot)
                        state.decode_slot = None
        for new in scheduler_output.scheduled_new_reqs:
            params = new.sampling_params
            options = None
            if params is not None and new.prompt_token_ids is not None:
                try:
                    options = admitted_options(params.extra_args)
                except WireError as exc:  # the scheduler finished it with an error already
                    logger.warning("obcache: request %s has no usable options: %s",
                                   new.req_id, exc)  # fmt: skip
            self._obcache_drop(new.req_id)  # a re-used id starts afresh
            if options is None:
                continue
            state = self.obcache_states[new.req_id] = RequestKvState.create(options)
            if state.buffers_decode_queries:
                state.decode_slot = self.obcache_queries.acquire()
            if self.obcache_records is not None:
                state.record = self.obcache_records[new.req_id] = {}
                while len(self.obcache_records) > _MAX_RECORDS:
                    self.obcache_records.popitem(last=False)
        # Requests that start from a compressed entry (adopted as a prefix-cache hit): their
        # first dead blocks are null in the block table.
        for req_id, dead in (getattr(scheduler_output, STARTS_ATTR, None) or {}).items():
            state = self.obcache_states.get(req_id)
            if state is not None:
                state.dead = dead
        note = getattr(scheduler_output, VERIFY_ATTR, None)
        self._obcache_verify = note
        if note is not None and note.entries:  # before vLLM runs the step's copies
            self.obcache_oracle.before_copies(self._obcache_read_kv, note)

    # -- the KV oracle (verification mode) ------------------------------------------------
    @property
    def obcache_oracle(self) -> KvOracle:
        if self._obcache_oracle is None:
            self._obcache_oracle = KvOracle(
                len(self.obcache_layer_index), self.cache_config.block_size
            )
        return self._obcache_oracle

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

    def _obcache_check_copies(self, scheduler_output) -> None:
        """The oracle's checks after the step's copies, before its forward pass."""
        note, self._obcache_verify = self._obcache_verify, None
        if note is None:
            return
        bs = self.cache_config.block_size
        written, owners, tables = {}, {}, {}
        for req_id, state in self.requests.items():
            ids = state.block_ids[0]
            for block in ids:
                if block:  # 0: vLLM's null block
                    owners.setdefault(block, req_id)
            n = scheduler_output.num_scheduled_tokens.get(req_id, 0)
            computed = state.num_computed_tokens
            for index in range(computed // bs, -(-(computed + n) // bs) if n else 0):
                if index < len(ids):  # (block, first slot this step writes in it)
                    written[ids[index]] = (req_id, max(0, computed - index * bs))
            tables[req_id] = ids
        copies = scheduler_output.kv_cache_block_copies or ()
        self._obcache_mismatches += self.obcache_oracle.after_copies(
            self._obcache_read_kv, note, tables, copies, written, owners
        )

    def _obcache_drop(self, req_id: str) -> None:
        state = self.obcache_states.pop(req_id, None)
        if state is not None and state.decode_slot is not None:
            self.obcache_queries.release(state.decode_slot)

    def _obcache_disable(self, state: RequestKvState, why: str) -> None:
        state.disabled = why
        state.drop_scoring_state()
        if state.decode_slot is not None:
            self.obcache_queries.release(state.decode_slot)
            state.decode_slot = None

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
            self._obcache_check_copies(self._obcache_output)
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
        orders: dict[str, EvictionOrder] = getattr(scheduler_output, ORDERS_ATTR, None) or {}
        if not self.obcache_states and not orders:
            return None
        batch = self.input_batch
        num_reqs = batch.num_reqs
        block_size = self.cache_config.block_size
        qsl = self.query_start_loc.cpu[: num_reqs + 1].tolist()
        computed = batch.num_computed_tokens_cpu[:num_reqs].tolist()
        dead, rows, writes = [], [], []
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
            prefill = computed[row] < prompt_len
            position, score_decode, active = None, False, prefill or order is not None
            if not prefill and state.decode_slot is not None and state.disabled is None:
                position = state.decode_count
                score_decode = order is not None or position + 1 >= self.obcache_queries.capacity
                active = active or score_decode
                writes.append((state.decode_slot, position, qsl[row]))
            plan_row = RowPlan(
                row=row,
                req_id=req_id,
                block_size=block_size,
                state=state,
                q_start=qsl[row],
                q_end=qsl[row + 1],
                logical_len=logical_len,
                prompt_len=prompt_len,
                prefill=prefill,
                order=order,
                decode_position=position,
                score_decode=score_decode,
                active=active or failure is not None,
            )
            plan_row.outcome.failure = failure
            rows.append(plan_row)
        # Orders for requests without a worker state (the worker never saw their options):
        # nothing is done for them; reported as faults so the scheduler stops ordering.
        self._obcache_untracked = sorted(set(orders) - {r.req_id for r in rows})
        head_reduce = self._obcache_tp()[0]
        # A layer ranking summed over the TP group is reduced row by row: not batched.
        rows, groups = _group_decode_orders(rows, batch_shared=head_reduce is None)
        decode_write = None
        if writes:  # (slots, positions, token index) as tensors on the model's device
            decode_write = tuple(
                torch.tensor(column, dtype=torch.int64).to(self.device, non_blocking=True)
                for column in zip(*writes, strict=True)
            )
        return StepPlan(
            dead=tuple(dead),
            rows=tuple(rows),
            block_size=block_size,
            layer_index=self.obcache_layer_index,
            decode_store=self.obcache_queries,
            decode_write=decode_write,
            groups=groups,
            head_reduce=head_reduce,
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
        untracked, self._obcache_untracked = self._obcache_untracked, []
        if plan is None or not (plan.rows or untracked):
            return
        num_layers = len(self.obcache_layer_index)
        tp_group = self._obcache_tp()[1]
        if tp_group is not None:  # every rank commits the same outcome (see agree_across_ranks)
            agree_across_ranks(plan.rows, num_layers, tp_group)
        applied, failures, states = [], [], {}
        for req_id in untracked:
            failures.append(RowFailure(req_id, "schedule", "untracked"))
            logger.warning(
                "obcache: eviction fault for request %s (stage=schedule reason=untracked): "
                "the worker has no eviction state for it; continues uncompressed",
                req_id,
            )
        for row in plan.rows:
            state, order, outcome = row.state, row.order, row.outcome
            compacted = outcome.compacted_layers
            failure = outcome.failure
            if row.decode_position is not None:  # the stored queries: scored now, or one more
                state.decode_count = 0 if row.score_decode else row.decode_position + 1
            if order is not None and failure is None and compacted != num_layers:
                failure = ("compact", "not_applied", f"{compacted} of {num_layers} layers")
            if order is not None and compacted == num_layers:
                if state.pressure_pending:  # compressed at last: from now on as kv_when always
                    state.pressure_pending = False
                    if state.buffers_decode_queries and state.decode_slot is None:
                        state.decode_slot = self.obcache_queries.acquire()
                state.dead = order.dead_after
                state.evictions += 1
                if state.record is not None:
                    state.record.setdefault(":orders", []).append((order.logical_len, row.prefill))
                state.tokens_evicted += order.tokens_evicted
                if order.logical_len <= row.prompt_len:  # during the prompt: the last one counts
                    state.kept_prompt = order.kept + row.prompt_len - order.logical_len
                applied.append(row.req_id)
            if failure is not None:
                torn = outcome.torn(num_layers)
                stage, reason, detail = failure
                failures.append(RowFailure(row.req_id, stage, reason, fatal=torn))
                self._obcache_disable(state, f"{stage}: {reason}")
                logger.warning(
                    "obcache: eviction fault for request %s (stage=%s reason=%s): %s; %s",
                    row.req_id, stage, reason, detail,
                    "its cache is torn: finished with an error" if torn
                    else "continues uncompressed",
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
        self._obcache_report = report

    def sample_tokens(self, grammar_output):
        output = super().sample_tokens(grammar_output)
        report, self._obcache_report = self._obcache_report, None
        mismatches, self._obcache_mismatches = self._obcache_mismatches, []
        if mismatches:
            if report is None:
                report = EvictionReport(applied=(), seconds=0.0)
            report = dataclasses.replace(report, mismatches=tuple(mismatches))
        if report is not None and output is not None:
            setattr(output, REPORT_ATTR, report)
        return output


def _group_decode_orders(
    rows: list[RowPlan], batch_shared: bool = True
) -> tuple[tuple[RowPlan, ...], tuple[RowGroup, ...]]:
    """Group the decode rows that can be batched (see ``core._group_after_attention``): orders,
    or stored decode queries to fold into the running scores (no order), with the same scoring
    options, resident count, query count, kept count and block shift; one
    ranking per layer only if ``batch_shared`` (not under tensor parallelism, where each row's
    ranking is all-reduced on its own). Rows of a group of two or more are marked ``grouped``."""
    buckets: dict[tuple, list[int]] = {}
    for i, r in enumerate(rows):
        if r.prefill or r.outcome.failure or (r.order is not None and r.order.pressure):
            continue
        if r.order is None and not r.score_decode:
            continue
        if not batch_shared and not r.state.options.per_head:
            continue
        o, state = r.state.options, r.state
        queries = 1 if r.decode_position is None else r.decode_position + 1
        kept, shift = (None, 0) if r.order is None else (
            r.order.kept, r.order.dead_after - r.order.dead_before)  # fmt: skip
        key = (o.scorer, o.pipeline, o.window, o.per_head, o.recent, o.sinks, o.decode,
               state.decode_mode, r.num_resident, queries, kept, shift)  # fmt: skip
        buckets.setdefault(key, []).append(i)
    groups = []
    rows = list(rows)
    for key, members in buckets.items():
        if len(members) < 2:
            continue
        for i in members:
            rows[i] = dataclasses.replace(rows[i], grouped=True)
        groups.append(RowGroup(tuple(rows[i] for i in members), num_queries=key[9], shift=key[11]))
    return tuple(rows), tuple(groups)
