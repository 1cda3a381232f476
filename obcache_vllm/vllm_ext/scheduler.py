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

Reporting (read by the API server, see :mod:`obcache_vllm.vllm_ext.server` and ``.stats``):

* every ``EngineCoreOutput`` of a budgeted request carries the request's KV outcome so far in
  ``kv_transfer_params`` as ``{"obcache": {...}}`` (:data:`OUTCOME_KEY`). That field passes
  from EngineCore to the front-end's ``RequestOutput`` untouched; budgeted requests are refused
  when a KV connector is configured, so it has no other user for them.
* ``make_stats`` adds ``SchedulerStats.obcache`` (a field the plugin injects, see
  :func:`obcache_vllm.vllm_ext.stats.install_scheduler_stats_field`): cumulative counters per
  (scorer, pipeline), plus the eviction timings and finished requests since the last stats.

Block accounting is decided here alone; the worker only chooses which tokens survive.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from obcache_vllm.options import KvOptions, parse_validated_kv_options
from obcache_vllm.planning import (
    ORDERS_ATTR,
    OUTCOME_KEY,
    REPORT_ATTR,
    STATS_ATTR,
    plan_eviction,
)

logger = logging.getLogger(__name__)

# Bound on what waits for the next make_stats (it runs every step when stats are on).
_PENDING_MAX = 4096


@dataclass
class SchedKvState:
    """Scheduler-side state of one budgeted request (created on add, dropped on finish)."""

    options: KvOptions
    prompt_len: int
    dead: int = 0
    # The prefill eviction (at the compress point) has been ordered.
    compressed: bool = False
    evictions: int = 0
    tokens_evicted: int = 0
    blocks_freed: int = 0
    # Prompt tokens left after the prefill eviction (None: not evicted at prefill).
    kept_prompt: int | None = None

    def outcome(self, resident: int) -> dict:
        """The request's KV outcome as reported to the client (``usage.obcache``)."""
        return {
            "resident_tokens": resident,
            "evicted_tokens": self.tokens_evicted,
            "freed_blocks": self.blocks_freed,
            "evictions": self.evictions,
            "prompt_tokens_kept": self.prompt_len if self.kept_prompt is None else self.kept_prompt,
            "budget": self.options.budget,
            "scorer": self.options.scorer,
            "pipeline": self.options.pipeline,
        }


@dataclass(frozen=True)
class FinishedKvRecord:
    """KV outcome of one finished budgeted request."""

    req_id: str
    resident_tokens: int
    tokens_evicted: int
    evictions: int
    prompt_len: int = 0
    kept_prompt: int = 0
    blocks_freed: int = 0
    scorer: str = ""
    pipeline: str = ""


@dataclass
class SchedulerEvictionTotals:
    """Cumulative counters of this engine (read by metrics and tests)."""

    evictions: int = 0
    tokens_evicted: int = 0
    blocks_freed: int = 0
    orders_not_applied: int = 0
    scoring_seconds: float = 0.0


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
        coordinator = self.kv_cache_manager.coordinator
        cache_blocks = coordinator.cache_blocks

        def cache_blocks_unless_budgeted(request, num_computed_tokens):
            if request.request_id in self.obcache_states:
                return
            cache_blocks(request, num_computed_tokens)

        coordinator.cache_blocks = cache_blocks_unless_budgeted
        managers = coordinator.single_type_managers
        if len(managers) != 1:
            raise RuntimeError("obcache-vllm supports single-group (non-hybrid) KV caches only")
        self._obcache_manager = managers[0]

    def add_request(self, request) -> None:
        params = request.sampling_params
        options = None
        if params is not None and request.request_id not in self.requests:
            options = parse_validated_kv_options(
                params.extra_args, request.num_prompt_tokens, self.max_model_len
            )
        if options is not None:
            request.skip_reading_prefix_cache = True
            self.obcache_states[request.request_id] = SchedKvState(
                options=options, prompt_len=request.num_prompt_tokens
            )
        super().add_request(request)

    def schedule(self, *args, **kwargs):
        output = super().schedule(*args, **kwargs)
        orders = {}
        for req_id in output.num_scheduled_tokens:  # values change below, keys do not
            state = self.obcache_states.get(req_id)
            if state is None:
                continue
            request = self.requests[req_id]
            if not state.compressed:
                point = state.options.compress_point(state.prompt_len)
                self._cut_chunk_at(output, request, point)
                if request.num_computed_tokens < point:
                    continue
                state.compressed = True
            elif not state.options.decode or request.is_prefill_chunk:
                continue
            order = plan_eviction(
                logical_len=request.num_computed_tokens,
                budget=state.options.budget,
                dead_blocks=state.dead,
                block_size=self.block_size,
            )
            if order is not None:
                self._check_writable(req_id, order)
                orders[req_id] = order
        setattr(output, ORDERS_ATTR, orders)
        return output

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
                raise RuntimeError(
                    f"request {req_id}: block {block.block_id} is shared or cached; "
                    "refusing to compact into it"
                )

    def update_from_output(self, scheduler_output, model_runner_output):
        orders = getattr(scheduler_output, ORDERS_ATTR, None) or {}
        report = getattr(model_runner_output, REPORT_ATTR, None)
        applied = set(report.applied) if report is not None else set()
        if report is not None:
            self.obcache_totals.scoring_seconds += report.seconds
            if report.applied:
                self._obcache_pending_seconds.append(report.seconds)
        self._obcache_step_outcomes = {}
        for req_id, order in orders.items():
            state = self.obcache_states.get(req_id)
            request = self.requests.get(req_id)
            if req_id not in applied:
                self.obcache_totals.orders_not_applied += 1
                logger.warning("eviction order for %s was not applied by the worker", req_id)
                continue
            if (
                state is None
                or request is None
                or request.status != RequestStatus.RUNNING
                or state.dead != order.dead_before
            ):
                continue
            self._obcache_manager._remove_blocks_in_range(
                req_id, order.dead_before, order.dead_after
            )
            if state.evictions == 0 and order.logical_len <= state.prompt_len:
                # The prefill eviction; with kv_compress_at the rest of the prompt is kept.
                state.kept_prompt = order.kept + state.prompt_len - order.logical_len
            state.dead = order.dead_after
            state.evictions += 1
            state.tokens_evicted += order.tokens_evicted
            state.blocks_freed += order.blocks_freed
            totals = self.obcache_totals
            totals.evictions += 1
            totals.tokens_evicted += order.tokens_evicted
            totals.blocks_freed += order.blocks_freed
            key = (state.options.scorer, state.options.pipeline)
            per_option = self.obcache_by_option.setdefault(key, [0, 0, 0])
            per_option[0] += order.tokens_evicted
            per_option[1] += order.blocks_freed
            per_option[2] += 1
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        if self.obcache_states or self._obcache_step_outcomes:
            self._attach_outcomes(outputs)
        return outputs

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
                    "seconds": seconds,
                    "finished": finished,
                },
            )
        return stats

    def _preempt_request(self, request, *args, **kwargs) -> None:
        super()._preempt_request(request, *args, **kwargs)
        state = self.obcache_states.get(request.request_id)
        if state is not None:
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

    def obcache_resident_tokens(self, req_id: str) -> int | None:
        """Tokens this budgeted request currently holds in the cache (None if not budgeted)."""
        state = self.obcache_states.get(req_id)
        request = self.requests.get(req_id)
        if state is None or request is None:
            return None
        return request.num_computed_tokens - state.dead * self.block_size
