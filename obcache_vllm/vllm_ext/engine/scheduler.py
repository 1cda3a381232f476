"""The scheduler side of eviction (EngineCore process): orders, block frees, prefix-cache fence.

``OBCacheScheduler`` is vLLM's synchronous ``Scheduler`` plus, for budgeted requests only:

* ``add_request``: parse the kv_* options; never read the prefix cache for the request.
* ``__init__``: never *register* a budgeted request's blocks in the prefix cache (its blocks are
  rewritten by compaction; a hash would keep serving the old contents to other requests).
* ``schedule``: after vLLM scheduled the step, issue an :class:`EvictionOrder` for each budgeted
  request whose compress point (the whole prompt, or ``kv_compress_at`` prompt tokens) is reached
  in this step (or, with ``kv_decode``, whose decode step leaves a whole block over budget). A
  prefill chunk that would run past ``kv_compress_at`` is cut at it, so that the rest of the
  prompt is computed on the compressed cache in later steps. Orders ride on the
  ``SchedulerOutput`` (an extra attribute survives the pickle to the worker).
* ``update_from_output``: for each order the worker reports as applied, and only if the request
  is still running with the same dead count, replace blocks ``[dead_before, dead_after)`` by the
  null block and return them to the pool (vLLM's sliding-window mechanism), in the same step.
* ``_preempt_request``: the request's KV is recomputed from scratch; reset its eviction state.
* ``_free_request``: drop the state (all blocks go back through vLLM's normal path).

Reporting (read by the API server, see :mod:`obcache_vllm.vllm_ext.frontend.server` and ``.stats``):

* every ``EngineCoreOutput`` of a budgeted request carries the request's KV outcome so far in
  ``kv_transfer_params`` as ``{"obcache": {...}}`` (:data:`OUTCOME_KEY`). That field passes
  from EngineCore to the front-end's ``RequestOutput`` untouched; budgeted requests are refused
  when a KV connector is configured, so it has no other user for them.
* ``make_stats`` adds ``SchedulerStats.obcache`` (a field the plugin injects, see
  :func:`obcache_vllm.vllm_ext.wire.install_scheduler_stats_field`): cumulative counters
  per (scorer, pipeline), plus the eviction timings and finished requests since the last stats.

Block accounting is decided here alone; the worker only chooses which tokens survive.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import deque

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.request import RequestStatus

from obcache_vllm.eviction import faults
from obcache_vllm.eviction.messages import EvictionOrder
from obcache_vllm.eviction.planning import peak_blocks, plan_eviction
from obcache_vllm.eviction.sched_state import (
    BlockNotWritableError,
    FinishedKvRecord,
    SchedKvState,
    SchedulerEvictionTotals,
    log_fault,
)
from obcache_vllm.options import WireError, admitted_options
from obcache_vllm.vllm_ext.wire import (
    DISABLED_ATTR,
    ORDERS_ATTR,
    OUTCOME_KEY,
    REPORT_ATTR,
    STATS_ATTR,
)

logger = logging.getLogger(__name__)

# Bound on what waits for the next make_stats (it runs every step when stats are on).
_PENDING_MAX = 4096


class OBCacheScheduler(Scheduler):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.obcache_states: dict[str, SchedKvState] = {}
        self.obcache_totals = SchedulerEvictionTotals()
        # Finished requests' final resident counts, drained by whoever reports them.
        self.obcache_finished: deque[FinishedKvRecord] = deque(maxlen=4096)
        # Cumulative (tokens evicted, blocks freed, evictions) per (scorer, pipeline).
        self.obcache_by_option: dict[tuple[str, str], list[int]] = {}
        # Drained by make_stats: eviction seconds per step, finished requests.
        self._obcache_pending_seconds: deque[float] = deque(maxlen=_PENDING_MAX)
        self._obcache_pending_finished: deque[FinishedKvRecord] = deque(maxlen=_PENDING_MAX)
        # Outcomes of budgeted requests freed during the current update_from_output.
        self._obcache_step_outcomes: dict[str, dict] = {}
        # Requests refused at add_request (no usable admitted options), and requests finished
        # with an error whose outputs the next update_from_output reports.
        self._obcache_refused: list[str] = []
        self._obcache_errored: list = []
        coordinator = self.kv_cache_manager.coordinator
        cache_blocks = coordinator.cache_blocks

        def cache_blocks_unless_budgeted(request, num_computed_tokens):
            if request.request_id in self.obcache_states:
                return
            cache_blocks(request, num_computed_tokens)

        coordinator.cache_blocks = cache_blocks_unless_budgeted
        manager = self.kv_cache_manager
        allocate_slots = manager.allocate_slots

        def allocate_slots_bounded(request, num_new_tokens, *args, **kwargs):
            """Admission of a kv_prefill_evict request: its bounded peak must fit, not its
            whole prompt (vLLM's ``full_sequence_must_fit`` gate for waiting requests)."""
            state = self.obcache_states.get(request.request_id)
            if (
                state is not None
                and state.options.prefill_evict
                and state.disabled is None
                and kwargs.get("full_sequence_must_fit")
            ):
                peak = self.obcache_peak_blocks(request, state)
                held = sum(1 for b in self._obcache_manager.req_to_blocks.get(
                    request.request_id, ()) if not b.is_null)  # fmt: skip
                if peak - held > manager.block_pool.get_num_free_blocks():
                    return None
                kwargs["full_sequence_must_fit"] = False
            return allocate_slots(request, num_new_tokens, *args, **kwargs)

        manager.allocate_slots = allocate_slots_bounded
        managers = coordinator.single_type_managers
        if len(managers) != 1:
            raise RuntimeError("obcache-vllm supports single-group (non-hybrid) KV caches only")
        self._obcache_manager = managers[0]

    def add_request(self, request) -> None:
        params = request.sampling_params
        options = None
        if params is not None and request.request_id not in self.requests:
            try:
                options = admitted_options(params.extra_args)
            except WireError as exc:
                self._count_failure("admission", "wire")
                log_fault(request.request_id, "admission", "wire", str(exc),
                          "finished with an error before it ran")  # fmt: skip
                self._obcache_refused.append(request.request_id)
        if options is not None:
            request.skip_reading_prefix_cache = True
            self.obcache_states[request.request_id] = SchedKvState(
                options=options,
                prompt_len=request.num_prompt_tokens,
                fault=faults.requested(params.extra_args),
            )
        super().add_request(request)

    def schedule(self, *args, **kwargs):
        if self._obcache_refused:  # never scheduled: finished now, reported in this step
            refused, self._obcache_refused = self._obcache_refused, []
            finished = self.finish_requests(refused, RequestStatus.FINISHED_ERROR)
            self._obcache_errored.extend(finished)
        output = super().schedule(*args, **kwargs)
        orders, disabled = {}, []
        for req_id in output.num_scheduled_tokens:  # values change below, keys do not
            state = self.obcache_states.get(req_id)
            if state is None or state.disabled is not None:
                continue
            try:
                order = self._plan_request(output, self.requests[req_id], state)
            except Exception as exc:  # contained: this request goes on uncompressed
                reason = "injected" if isinstance(exc, faults.InjectedFault) else type(exc).__name__
                self._contain(req_id, state, "schedule", reason, str(exc), torn=False)
                disabled.append(req_id)
                continue
            if order is not None:
                orders[req_id] = order
        setattr(output, ORDERS_ATTR, orders)
        if disabled:
            setattr(output, DISABLED_ATTR, tuple(disabled))
        return output

    def _plan_request(self, output, request, state: SchedKvState) -> EvictionOrder | None:
        """This step's order for one budgeted request, or None (may cut its prefill chunk)."""
        final = True  # the eviction at the compress point, or a decode-time one
        if not state.compressed:
            point = state.options.compress_point(state.prompt_len)
            self._cut_chunk_at(output, request, point)
            if request.num_computed_tokens < point:
                if not state.options.prefill_evict:
                    return None
                final = False  # kv_prefill_evict: after this chunk too
        elif not state.options.decode or request.is_prefill_chunk:
            return None
        order = plan_eviction(
            logical_len=request.num_computed_tokens,
            budget=state.options.budget,
            dead_blocks=state.dead,
            block_size=self.block_size,
        )
        state.compressed = state.compressed or final
        if order is None:
            return None
        fault = state.fault if state.fault and state.fault.stage in ("schedule", "desync") else None
        if fault is not None:
            state.fault = None  # one shot
            if fault.stage == "schedule":
                raise faults.InjectedFault("schedule")
        self._check_writable(request.request_id, order)
        if fault is not None:  # "desync": an order the worker must refuse
            return dataclasses.replace(order, logical_len=order.logical_len + 1)
        return order

    @staticmethod
    def _cut_chunk_at(output, request, point: int) -> None:
        """Shorten this step's chunk of ``request`` so that it ends at token ``point``.

        Runs after ``Scheduler.schedule`` has advanced ``num_computed_tokens`` and
        ``num_in_flight_tokens`` by the scheduled count (``_update_after_schedule``); both are
        moved back together with the step's counts. Blocks allocated for the cut tokens stay with
        the request and serve its next chunk. The request remains a prefill chunk.
        """
        over = request.num_computed_tokens - point
        scheduled = output.num_scheduled_tokens[request.request_id]
        if over <= 0 or over >= scheduled:
            return
        output.num_scheduled_tokens[request.request_id] = scheduled - over
        output.total_num_scheduled_tokens -= over
        request.num_computed_tokens -= over
        request.num_in_flight_tokens -= over
        request.is_prefill_chunk = True

    def _check_writable(self, req_id: str, order) -> None:
        """Every block that receives kept tokens must be this request's alone and unhashed."""
        blocks = self._obcache_manager.req_to_blocks[req_id]
        pool = self.kv_cache_manager.block_pool
        last = -(-order.logical_len // order.block_size)
        for block in blocks[order.dead_after : last]:
            if not pool.is_block_writable(block):
                raise BlockNotWritableError(
                    f"request {req_id}: block {block.block_id} is shared or cached; "
                    "refusing to compact into it"
                )

    def update_from_output(self, scheduler_output, model_runner_output):
        orders = getattr(scheduler_output, ORDERS_ATTR, None) or {}
        report = getattr(model_runner_output, REPORT_ATTR, None)
        self._obcache_step_outcomes = {}
        torn: list[str] = []
        if report is None:
            for req_id in orders:  # the worker's report of these orders is missing
                self.obcache_totals.orders_not_applied += 1
                self._count_failure("report", "missing")
                log_fault(
                    req_id, "report", "missing", "no worker report for its order",
                    "its blocks are freed once a later report shows the worker's state",
                )  # fmt: skip
        else:
            self.obcache_totals.scoring_seconds += report.seconds
            if report.applied:
                self._obcache_pending_seconds.append(report.seconds)
            for req_id, row in report.states.items():
                self._reconcile(req_id, row)
            for failure in report.failures:
                state = self.obcache_states.get(failure.req_id)
                if state is not None:
                    self._contain(
                        failure.req_id, state, failure.stage, failure.reason, "worker",
                        torn=failure.fatal,
                    )  # fmt: skip
                if failure.fatal:
                    torn.append(failure.req_id)
        errored, self._obcache_errored = self._obcache_errored, []
        if torn:
            errored += self.finish_requests(torn, RequestStatus.FINISHED_ERROR)
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        for request in errored:  # as vLLM reports its own per-request errors
            eco = outputs.get(request.client_index)
            if eco is None:
                eco = outputs[request.client_index] = EngineCoreOutputs()
            eco.outputs.append(
                EngineCoreOutput(
                    request_id=request.request_id,
                    new_token_ids=[],
                    finish_reason=request.get_finished_reason(),
                    events=request.take_events(),
                    trace_headers=request.trace_headers,
                )
            )
        if self.obcache_states or self._obcache_step_outcomes:
            self._attach_outcomes(outputs)
        return outputs

    def _reconcile(self, req_id: str, row) -> None:
        """Adopt the worker's cumulative state of a request: free the head blocks it has
        compacted away and that are not free yet (this step's order, or one whose report was
        lost), and account its evictions. Only for a running request."""
        state = self.obcache_states.get(req_id)
        request = self.requests.get(req_id)
        if state is None or request is None or request.status != RequestStatus.RUNNING:
            return
        per_option = self.obcache_by_option.setdefault(
            (state.options.scorer, state.options.pipeline), [0, 0, 0]
        )
        totals = self.obcache_totals
        if row.dead > state.dead:
            self._obcache_manager._remove_blocks_in_range(req_id, state.dead, row.dead)
            freed = row.dead - state.dead
            state.blocks_freed += freed
            totals.blocks_freed += freed
            per_option[1] += freed
        new_tokens = row.tokens_evicted - state.tokens_evicted
        new_events = row.evictions - state.evictions
        if new_tokens or new_events:
            per_option[0] += new_tokens
            per_option[2] += new_events
            totals.tokens_evicted += new_tokens
            totals.evictions += new_events
        state.dead = row.dead
        state.evictions = row.evictions
        state.tokens_evicted = row.tokens_evicted
        if row.kept_prompt is not None:
            state.kept_prompt = row.kept_prompt

    def _count_failure(self, stage: str, reason: str) -> None:
        failures = self.obcache_totals.failures
        failures[(stage, reason)] = failures.get((stage, reason), 0) + 1

    def _contain(self, req_id, state: SchedKvState, stage, reason, detail, *, torn) -> None:
        """Stop evicting one request after a fault: log it with its id and count it."""
        self._count_failure(stage, reason)
        state.disabled = f"{stage}: {reason}"
        if torn:
            self.obcache_totals.failed_requests += 1
        fate = "its cache is torn: finished with an error" if torn else "continues uncompressed"
        log_fault(req_id, stage, reason, detail, fate)

    def _attach_outcomes(self, outputs) -> None:
        """Put each budgeted request's KV outcome on its output (see the module docstring)."""
        finished = self._obcache_step_outcomes
        for eco in outputs.values():
            for out in eco.outputs:
                if out.kv_transfer_params is not None:
                    continue
                req_id = out.request_id
                outcome = finished.get(req_id)
                if outcome is None:
                    resident = self.obcache_resident_tokens(req_id)
                    if resident is None:
                        continue
                    outcome = self.obcache_states[req_id].outcome(resident)
                out.kv_transfer_params = {OUTCOME_KEY: outcome}
        self._obcache_step_outcomes = {}

    def make_stats(self, *args, **kwargs):
        stats = super().make_stats(*args, **kwargs)
        if stats is not None:
            seconds = list(self._obcache_pending_seconds)
            finished = [
                [r.resident_tokens, r.kept_prompt, r.prompt_len]
                for r in self._obcache_pending_finished
            ]
            self._obcache_pending_seconds.clear()
            self._obcache_pending_finished.clear()
            setattr(
                stats,
                STATS_ATTR,
                {
                    "by_option": [[s, p, *v] for (s, p), v in self.obcache_by_option.items()],
                    "failures": [[s, r, n] for (s, r), n in self.obcache_totals.failures.items()],
                    "compressed_preemptions": self.obcache_totals.compressed_preemptions,
                    "seconds": seconds,
                    "finished": finished,
                },
            )
        return stats

    def _preempt_request(self, request, *args, **kwargs) -> None:
        super()._preempt_request(request, *args, **kwargs)
        state = self.obcache_states.get(request.request_id)
        if state is not None:
            if state.dead > 0 or state.compressed:
                # Its KV is gone; recomputed from the tokens, the budget evicts it again.
                self.obcache_totals.compressed_preemptions += 1
                logger.info("obcache: compressed request %s preempted (%d evictions so far): "
                            "its KV is recomputed and evicted again", request.request_id,
                            state.evictions)
            state.dead = 0
            state.compressed = False
            state.kept_prompt = None

    def _free_request(self, request, *args, **kwargs):
        state = self.obcache_states.pop(request.request_id, None)
        if state is not None:
            resident = request.num_computed_tokens - state.dead * self.block_size
            record = FinishedKvRecord(
                request.request_id,
                resident,
                state.tokens_evicted,
                state.evictions,
                prompt_len=state.prompt_len,
                kept_prompt=state.prompt_len if state.kept_prompt is None else state.kept_prompt,
                blocks_freed=state.blocks_freed,
                scorer=state.options.scorer,
                pipeline=state.options.pipeline,
            )
            self.obcache_finished.append(record)
            self._obcache_pending_finished.append(record)
            self._obcache_step_outcomes[request.request_id] = state.outcome(resident)
        return super()._free_request(request, *args, **kwargs)

    def obcache_peak_blocks(self, request, state: SchedKvState) -> int:
        """Worst-case blocks of a budgeted request (see :func:`planning.peak_blocks`)."""
        params = request.sampling_params
        return peak_blocks(
            prompt_len=state.prompt_len,
            max_tokens=params.max_tokens or 1,
            block_size=self.block_size,
            chunk=self.scheduler_config.max_num_batched_tokens,
            budget=state.options.budget,
            decode=state.options.decode,
            prefill_evict=state.options.prefill_evict,
        )

    def obcache_resident_tokens(self, req_id: str) -> int | None:
        """Tokens this budgeted request currently holds in the cache (None if not budgeted)."""
        state = self.obcache_states.get(req_id)
        request = self.requests.get(req_id)
        if state is None or request is None:
            return None
        return request.num_computed_tokens - state.dead * self.block_size
