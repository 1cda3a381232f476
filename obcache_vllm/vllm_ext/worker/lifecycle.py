"""The worker's request lifecycle of eviction, knowing no model runner: plan, commit, report.

:class:`WorkerEviction` is what every runner binding drives, once per step, with what the
runner knows (vLLM's V1 binding: :class:`~obcache_vllm.vllm_ext.worker.runner.
EvictingRunnerMixin`; a Model Runner V2 binding would drive the same object):

1. :meth:`~WorkerEviction.update_states` with the step's ``SchedulerOutput`` (the scheduler's
   message, the same whichever runner executes it): new requests take their admitted options
   from the wire form; resumed ones restart from scratch; finished ones are dropped.
2. :meth:`~WorkerEviction.make_plan` with the batch as the runner laid it out
   (:class:`BatchRows`): the :class:`~obcache_vllm.eviction.step.StepPlan` the attention
   builders and impls apply. An order that does not match the worker's state is not applied
   (never raised): it is reported as a contained ``desync`` fault.
3. :meth:`~WorkerEviction.commit` after the forward pass (an order counts as applied only if
   every layer compacted it; contained faults become the report), then
   :meth:`~WorkerEviction.take_report` for the step's ``ModelRunnerOutput``. The report carries
   each budgeted row's cumulative state, so a lost report is made good by the next one.

KV oracle (verification mode, :mod:`obcache_vllm.eviction.oracle`): when the scheduler output
carries a ``VerifyNote``, what each new entry's donor left is fingerprinted in step 1 (before
vLLM runs the step's block copies) and checked by :meth:`~WorkerEviction.check_copies` (after
the copies, before the forward pass); mismatches ride on the report. The KV is read through a
``read_kv(layer, block_ids, num_tokens)`` the binding supplies.

Tensor parallelism: every rank runs this on its own KV heads with the same plan; the ranks
agree on every row's outcome before committing
(:func:`~obcache_vllm.eviction.step.agree_across_ranks`): only rank 0 reports.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from obcache_vllm.eviction.heads import HeadLayout
from obcache_vllm.eviction.layer import finish_deferred
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
from obcache_vllm.vllm_ext.wire import DISABLED_ATTR, ORDERS_ATTR, STARTS_ATTR, VERIFY_ATTR

logger = logging.getLogger(__name__)

_MAX_RECORDS = 256
ReadKv = Callable[[int, Sequence[int], int], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class BatchRows:
    """The step's batch as the runner laid it out (host values): row ``i`` is request
    ``req_ids[i]``, its queries are ``query_start_loc[i]:query_start_loc[i + 1]`` of the flat
    token batch, ``num_computed[i]`` of its tokens were cached before the step."""

    req_ids: Sequence[str]
    query_start_loc: Sequence[int]
    num_computed: Sequence[int]
    prompt_lens: Mapping[str, int]


class WorkerEviction:
    """The worker half of eviction for one runner (see the module docstring).

    ``num_layers`` and ``block_size`` are the runner's (one KV-cache group); ``records``: keep
    each request's kept positions (verification, ``OBCACHE_VLLM_RECORD_KEEP=1``).
    """

    def __init__(self, block_size: int, records: bool = False, model: str | None = None) -> None:
        self.block_size = block_size
        self.model = model  # the served model's path or id: its KL calibration's name
        self.states: dict[str, RequestKvState] = {}
        self.queries = DecodeQueryStore()
        self.records: OrderedDict[str, dict] | None = OrderedDict() if records else None
        self.plan: StepPlan | None = None  # the step's plan, until committed
        self.report: EvictionReport | None = None  # the step's report, until taken
        self._num_layers: int | None = None
        self._untracked: list[str] = []
        self._oracle: KvOracle | None = None  # created by the first VerifyNote
        self._verify = None  # the step's VerifyNote until its checks have run
        self._mismatches: list = []

    # -- 1. request lifecycle -------------------------------------------------------------
    def update_states(self, scheduler_output, read_kv: ReadKv, num_layers: int) -> None:
        """Step 1: the requests as this step's ``SchedulerOutput`` leaves them."""
        self._num_layers = num_layers
        for req_id in scheduler_output.finished_req_ids:
            self.drop(req_id)
        for req_id in getattr(scheduler_output, DISABLED_ATTR, None) or ():
            state = self.states.get(req_id)
            if state is not None and state.disabled is None:
                self.disable(state, "stopped by the scheduler")
        for req_id in scheduler_output.scheduled_cached_reqs.resumed_req_ids:
            state = self.states.get(req_id)
            if state is not None:
                state.reset()
                if state.options.when == "pressure":  # recomputed: stock again until short
                    state.pressure_pending = True
                    if state.decode_slot is not None:
                        self.queries.release(state.decode_slot)
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
            self.drop(new.req_id)  # a re-used id starts afresh
            if options is None:
                continue
            state = self.states[new.req_id] = RequestKvState.create(options)
            if state.buffers_decode_queries:
                state.decode_slot = self.queries.acquire()
            if self.records is not None:
                state.record = self.records[new.req_id] = {}
                while len(self.records) > _MAX_RECORDS:
                    self.records.popitem(last=False)
        # Requests that start from a compressed entry (adopted as a prefix-cache hit): their
        # first dead blocks are null in the block table; a session of a pipeline whose heads
        # own their memory continues its per-head layout.
        for req_id, (dead, layout) in (getattr(scheduler_output, STARTS_ATTR, None) or {}).items():
            state = self.states.get(req_id)
            if state is not None:
                state.dead = dead
                if layout is not None:
                    state.head_layout = HeadLayout.from_wire(layout)
        note = getattr(scheduler_output, VERIFY_ATTR, None)
        self._verify = note
        if note is not None and note.entries:  # before vLLM runs the step's copies
            self.oracle.before_copies(read_kv, note)

    def drop(self, req_id: str) -> None:
        state = self.states.pop(req_id, None)
        if state is not None and state.decode_slot is not None:
            self.queries.release(state.decode_slot)

    def disable(self, state: RequestKvState, why: str) -> None:
        state.disabled = why
        state.drop_scoring_state()
        if state.decode_slot is not None:
            self.queries.release(state.decode_slot)
            state.decode_slot = None

    # -- the KV oracle (verification mode) ------------------------------------------------
    @property
    def oracle(self) -> KvOracle:
        if self._oracle is None:
            self._oracle = KvOracle(self._num_layers or 0, self.block_size)
        return self._oracle

    def check_copies(self, scheduler_output, tables: Mapping[str, tuple[Sequence[int], int]],
                     read_kv: ReadKv) -> None:  # fmt: skip
        """The oracle's checks after the step's copies, before its forward pass. ``tables``:
        every request the runner holds -> (its block ids, its tokens computed before the
        step)."""
        note, self._verify = self._verify, None
        if note is None:
            return
        bs = self.block_size
        written, owners, blocks = {}, {}, {}
        for req_id, (ids, computed) in tables.items():
            for block in ids:
                if block:  # 0: vLLM's null block
                    owners.setdefault(block, req_id)
            n = scheduler_output.num_scheduled_tokens.get(req_id, 0)
            for index in range(computed // bs, -(-(computed + n) // bs) if n else 0):
                if index < len(ids):  # (block, first slot this step writes in it)
                    written[ids[index]] = (req_id, max(0, computed - index * bs))
            blocks[req_id] = ids
        copies = scheduler_output.kv_cache_block_copies or ()
        self._mismatches += self.oracle.after_copies(read_kv, note, blocks, copies, written,
                                                     owners)  # fmt: skip

    # -- 2. the step plan -----------------------------------------------------------------
    def make_plan(self, scheduler_output, batch: BatchRows, layer_index: Mapping[str, int],
                  device, head_reduce=None) -> StepPlan | None:  # fmt: skip
        """Step 2: the step's plan over ``batch`` (None: nothing to do this step). ``device``:
        where the decode queries' write indices go; ``head_reduce``: the TP group's
        all-reduce of a layer ranking shared by the heads (None on one rank)."""
        orders: dict[str, EvictionOrder] = getattr(scheduler_output, ORDERS_ATTR, None) or {}
        self.plan = None
        if not self.states and not orders:
            return None
        qsl, computed, block_size = batch.query_start_loc, batch.num_computed, self.block_size
        dead, rows, writes, layouts = [], [], [], {}
        for row, req_id in enumerate(batch.req_ids):
            state = self.states.get(req_id)
            dead.append(state.dead if state is not None else 0)
            if state is None:
                continue
            if state.head_layout is not None:
                layouts[row] = state.head_layout
            logical_len = computed[row] + (qsl[row + 1] - qsl[row])
            order, failure = orders.get(req_id), None
            if state.disabled is not None:
                order = None  # a stale order for a request whose eviction stopped
            elif order is not None and (
                order.logical_len != logical_len or order.dead_before != state.dead
            ):
                detail = f"order {order} vs worker logical_len={logical_len} dead={state.dead}"
                order, failure = None, ("schedule", "desync", detail)
            prompt_len = batch.prompt_lens[req_id]
            prefill = computed[row] < prompt_len
            position, score_decode, active = None, False, prefill or order is not None
            stored = None
            summed = state.decode_slot is not None and state.disabled is None
            if not prefill and summed and qsl[row + 1] - qsl[row] > 1:
                # Several decode-time queries in one row: a preempted request recomputing
                # its output. All of them are folded now, after the ones stored before.
                stored, score_decode, active = state.decode_count, True, True
            elif not prefill and summed:
                position = state.decode_count
                score_decode = order is not None or position + 1 >= self.queries.capacity
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
                decode_stored=stored,
                score_decode=score_decode,
                active=active or failure is not None,
            )
            plan_row.outcome.failure = failure
            rows.append(plan_row)
        # Orders for requests without a worker state (the worker never saw their options):
        # nothing is done for them; reported as faults so the scheduler stops ordering.
        self._untracked = sorted(set(orders) - {r.req_id for r in rows})
        # A layer ranking summed over the TP group is reduced row by row: not batched.
        rows, groups = _group_decode_orders(rows, batch_shared=head_reduce is None)
        decode_write = None
        if writes:  # (slots, positions, token index) as tensors on the model's device
            decode_write = tuple(
                torch.tensor(column, dtype=torch.int64).to(device, non_blocking=True)
                for column in zip(*writes, strict=True)
            )
        self.plan = StepPlan(
            dead=tuple(dead),
            rows=tuple(rows),
            block_size=block_size,
            layer_index=layer_index,
            decode_store=self.queries,
            decode_write=decode_write,
            groups=groups,
            head_reduce=head_reduce,
            head_layouts=layouts,
        )
        return self.plan

    def _calibrations(self, num_layers: int) -> tuple:
        """The served model's KL calibrations (``kv_budget: {"max_kl": ..}``), one per selection
        measured; admission refuses a KL target whose selection has none, so a KL order
        without one is a fault."""
        if self.model is None:
            return ()
        from obcache_vllm.scoring.calibration import for_model

        return for_model(self.model, num_layers)

    # -- 3. commit and report -------------------------------------------------------------
    def commit(self, num_layers: int, tp_group=None) -> None:
        """Step 3: what every layer did to the step's plan, as the step's report."""
        plan, self.plan = self.plan, None
        untracked, self._untracked = self._untracked, []
        if plan is None or not (plan.rows or untracked):
            return
        # error targets: every layer has scored by now
        finish_deferred(plan, num_layers, self._calibrations(num_layers))
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
            elif row.decode_stored is not None:  # a row of several: every one scored now
                state.decode_count = 0
            if order is not None and failure is None and compacted != num_layers:
                failure = ("compact", "not_applied", f"{compacted} of {num_layers} layers")
            if order is not None and compacted == num_layers:
                if state.pressure_pending:  # compressed at last: from now on as kv_when always
                    state.pressure_pending = False
                    if state.buffers_decode_queries and state.decode_slot is None:
                        state.decode_slot = self.queries.acquire()
                dead_after, kept = order.dead_after, order.kept
                if outcome.chosen is not None:  # an error target: what it chose
                    dead_after, kept, estimated = outcome.chosen
                    state.chosen = (kept, estimated)
                if dead_after > state.dead:
                    state.evictions += 1
                    if state.record is not None:
                        state.record.setdefault(":orders", []).append(
                            (order.logical_len, row.prefill))  # fmt: skip
                state.tokens_evicted += order.resident_before - kept
                state.dead = dead_after
                if outcome.head_blocks:  # its heads own their memory from now on
                    counts = [outcome.head_blocks[i][0] for i in range(num_layers)]
                    state.head_layout = HeadLayout(torch.tensor(counts, dtype=torch.int64),
                                                   outcome.head_blocks[0][1])  # fmt: skip
                if order.logical_len <= row.prompt_len:  # during the prompt: the last one counts
                    state.kept_prompt = kept + row.prompt_len - order.logical_len
                applied.append(row.req_id)
            if failure is not None:
                torn = outcome.torn(num_layers)
                stage, reason, detail = failure
                failures.append(RowFailure(row.req_id, stage, reason, fatal=torn))
                self.disable(state, f"{stage}: {reason}")
                logger.warning(
                    "obcache: eviction fault for request %s (stage=%s reason=%s): %s; %s",
                    row.req_id, stage, reason, detail,
                    "its cache is torn: finished with an error" if torn
                    else "continues uncompressed",
                )  # fmt: skip
            layout = state.head_layout
            states[row.req_id] = RowState(
                state.dead, state.evictions, state.tokens_evicted, state.kept_prompt,
                state.chosen, None if layout is None else layout.to_wire(),
            )
        self.report = EvictionReport(
            applied=tuple(applied),
            seconds=float(sum(plan.timings)),
            states=states,
            failures=tuple(failures),
        )

    def take_report(self) -> EvictionReport | None:
        """The step's report for its ``ModelRunnerOutput`` (the oracle's mismatches on it),
        or None when there is nothing to report."""
        report, self.report = self.report, None
        mismatches, self._mismatches = self._mismatches, []
        if mismatches:
            if report is None:
                report = EvictionReport(applied=(), seconds=0.0)
            report = dataclasses.replace(report, mismatches=tuple(mismatches))
        return report


class _DecodeBucket(NamedTuple):
    """What decode rows batched together share (their scoring options and shapes)."""

    scorer: str
    pipeline: str
    window: int
    per_head: bool
    recent: int
    sinks: int
    decode: bool
    decode_mode: object
    num_resident: int
    queries: int
    kept: object
    shift: int


def _group_decode_orders(
    rows: list[RowPlan], batch_shared: bool = True
) -> tuple[tuple[RowPlan, ...], tuple[RowGroup, ...]]:
    """Group the decode rows that can be batched (see
    :func:`obcache_vllm.eviction.layer._group_after_attention`): orders,
    or stored decode queries to fold into the running scores (no order), with the same scoring
    options, resident count, query count, kept count and block shift; one
    ranking per layer only if ``batch_shared`` (not under tensor parallelism, where each row's
    ranking is all-reduced on its own). Rows of a group of two or more are marked ``grouped``."""
    buckets: dict[_DecodeBucket, list[int]] = {}
    for i, r in enumerate(rows):
        if r.prefill or r.outcome.failure or (r.order is not None and r.order.pressure):
            continue
        if r.q_end - r.q_start > 1:  # several decode-time queries (a recompute): on its own
            continue
        if r.state.pipeline.heads_own_memory:  # its heads hold different counts: on its own
            continue
        if r.order is None and not r.score_decode:
            continue
        if not batch_shared and not r.state.options.per_head:
            continue
        o, state = r.state.options, r.state
        queries = 1 if r.decode_position is None else r.decode_position + 1
        kept, shift = (None, 0) if r.order is None else (
            r.order.kept, r.order.dead_after - r.order.dead_before)  # fmt: skip
        key = _DecodeBucket(o.scorer, o.pipeline, o.window, o.per_head, o.recent, o.sinks,
                            o.decode, state.decode_mode, r.num_resident, queries, kept,
                            shift)  # fmt: skip
        buckets.setdefault(key, []).append(i)
    groups = []
    rows = list(rows)
    for key, members in buckets.items():
        if len(members) < 2:
            continue
        for i in members:
            rows[i] = dataclasses.replace(rows[i], grouped=True)
        groups.append(RowGroup(tuple(rows[i] for i in members), num_queries=key.queries,
                               shift=key.shift))  # fmt: skip
    return tuple(rows), tuple(groups)
