"""The scheduler side of eviction (EngineCore process): vLLM's ``Scheduler`` over the block ledger.

:class:`OBCacheScheduler` is vLLM's synchronous ``Scheduler`` plus, for budgeted requests only
(a request without admitted options is never touched):

* ``add_request``: decode the admitted options (:func:`~obcache_vllm.options.
  admitted_options`) and open the request's record in the
  :class:`~obcache_vllm.eviction.ledger.BlockLedger`. A request with kv_* fields but no
  usable wire form, or a budgeted streaming-input (``resumable``) one, which admission
  refuses, is a counted fault: finished with an error before it runs.
* ``_get_local_prefix_cache_hit``: the exact part of vLLM's prefix hit, or a compressed entry
  to adopt (:mod:`.prefix`); the worker learns an adopted request's dead blocks from the
  step's ``obcache_starts``.
* ``schedule``: after vLLM scheduled the step, ask the ledger for each budgeted request's
  :class:`~obcache_vllm.eviction.messages.EvictionOrder` (at the compress point, or with
  ``kv_decode`` when a decode step leaves a whole block over budget). A prefill chunk that
  would run past the compress point is cut at it, so the rest of the prompt is computed on
  the compressed cache in later steps. Orders ride on the ``SchedulerOutput``.
* ``update_from_output``: the worker's report (on the ``ModelRunnerOutput``) is committed to
  the ledger, which says which head blocks to free now; :mod:`.blocks` frees them in vLLM's
  pool, in the same step, only for a request still running. A torn cache (some layers
  compacted) finishes that request alone with an error.
* ``_preempt_request`` / ``_free_request``: reset / release the request's record.

Block accounting is decided by the ledger alone; the worker only chooses which tokens survive.
What reaches the API server (``usage.obcache``, metrics) is assembled by :mod:`.reporting`.
"""

from __future__ import annotations

import logging
from collections import deque

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.request import RequestStatus

from obcache_vllm import settings
from obcache_vllm.eviction.faults import InjectedFault
from obcache_vllm.eviction.ledger import BlockLedger, RequestBlocks
from obcache_vllm.eviction.messages import EvictionOrder
from obcache_vllm.eviction.oracle import VERIFY_ENV, AdoptNote, EntryNote, VerifyNote
from obcache_vllm.options import WireError, admitted_options
from obcache_vllm.vllm_ext.engine.blocks import PoolAdapter
from obcache_vllm.vllm_ext.engine.prefix import PrefixAdapter
from obcache_vllm.vllm_ext.engine.pressure import PressurePlanner
from obcache_vllm.vllm_ext.engine.reporting import EngineReporter, log_fault
from obcache_vllm.vllm_ext.groups import evicting_group, window_blocks
from obcache_vllm.vllm_ext.wire import (
    DISABLED_ATTR,
    ORDERS_ATTR,
    REPORT_ATTR,
    STARTS_ATTR,
    VERIFY_ATTR,
)

logger = logging.getLogger(__name__)


class OBCacheScheduler(Scheduler):
    """vLLM's ``Scheduler`` with per-request KV eviction (see the module docstring)."""

    def __new__(cls, *args, **kwargs):
        """vLLM's own ``Scheduler`` (:class:`StockLayoutScheduler`) for a KV cache with no group
        budgets can evict in (:func:`~obcache_vllm.vllm_ext.groups.evicting_group`: e.g. two
        groups of global layers, Mamba): such a model is served as stock vLLM serves it, and a
        budgeted request that got past admission is finished with an error, never served
        silently unbudgeted. EngineCore builds the scheduler with keywords."""
        config = kwargs.get("kv_cache_config", args[1] if len(args) > 1 else None)
        group = evicting_group(config) if config is not None else None
        if group is not None and group.index is None:
            logger.info("obcache: %s: vLLM's own scheduler, budgets refused", group.reason)
            plain = Scheduler.__new__(StockLayoutScheduler)
            plain.obcache_reason = group.reason
            plain.__init__(*args, **kwargs)
            return plain
        return super().__new__(cls)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        group = evicting_group(self.kv_cache_config)
        if group.hybrid:
            logger.info("obcache: %d KV-cache groups (a hybrid model): budgets evict in group "
                        "%d (global layers); the sliding-window groups run as stock",
                        group.num_groups, group.index)  # fmt: skip
        self.obcache_ledger = BlockLedger(self.block_size)
        self.obcache_pool = PoolAdapter(
            self.kv_cache_manager,
            self.obcache_ledger,
            self.scheduler_config.max_num_batched_tokens,
            group.index,
            window_blocks(self.kv_cache_config, group, self.vllm_config),
        )
        self.obcache_prefix = PrefixAdapter(self, self.obcache_pool)
        self.obcache_pressure = PressurePlanner(self, self.obcache_ledger, self.obcache_pool)
        self.obcache_reporter = EngineReporter(
            self.obcache_ledger,
            self.obcache_prefix.counts,
            self.obcache_pressure.counts,
            self.obcache_pool,
            lambda: self.obcache_prefix.held_blocks,
        )
        # Requests refused at add_request (no usable admitted options), and requests finished
        # with an error whose outputs the next update_from_output reports.
        self._obcache_refused: list[str] = []
        self._obcache_errored: list = []
        # The KV oracle (OBCACHE_VLLM_VERIFY=1, eviction/oracle.py): each step tells the worker
        # which entries were made and which admitted requests adopted one; its mismatches are
        # counted faults, the latest kept here for readers (tests, the stress).
        self.obcache_verify = settings.flag(VERIFY_ENV)
        self.obcache_prefix.record_made = self.obcache_verify
        self.obcache_mismatches: deque = deque(maxlen=1024)

    # Read by tests, the teacher-forcing tool and the fault hooks.
    @property
    def obcache_totals(self):
        return self.obcache_ledger.totals

    @property
    def obcache_finished(self):
        return self.obcache_ledger.finished

    @property
    def obcache_states(self) -> dict[str, RequestBlocks]:
        return self.obcache_ledger.requests

    def obcache_resident_tokens(self, req_id: str) -> int | None:
        """Tokens this budgeted request currently holds in the cache (None if not budgeted)."""
        blocks = self.obcache_ledger.get(req_id)
        request = self.requests.get(req_id)
        if blocks is None or request is None:
            return None
        return blocks.resident(request.num_computed_tokens)

    # -- lifecycle -----------------------------------------------------------------------------
    def add_request(self, request) -> None:
        params = request.sampling_params
        options = None
        if params is not None and request.request_id not in self.requests:
            try:
                options = admitted_options(params.extra_args)
            except WireError as exc:
                self.obcache_totals.count_failure("admission", "wire")
                log_fault(request.request_id, "admission", "wire", str(exc),
                          "finished with an error before it ran")  # fmt: skip
                self._obcache_refused.append(request.request_id)
            if options is not None and request.resumable:  # admission refuses these
                options = None
                self.obcache_totals.count_failure("admission", "resumable")
                log_fault(request.request_id, "admission", "resumable",
                          "a budgeted streaming-input request bypassed admission",
                          "finished with an error before it ran")  # fmt: skip
                self._obcache_refused.append(request.request_id)
        if options is not None:
            blocks = self.obcache_ledger.open(
                request.request_id, options, request.num_prompt_tokens
            )
            blocks.may_read = not request.skip_reading_prefix_cache
            # vLLM's own lookup (and its hit statistics) only for requests that can read.
            request.skip_reading_prefix_cache = not (blocks.reads_cache or blocks.entry_kind)
        super().add_request(request)

    def _get_local_prefix_cache_hit(self, request, *args):
        # *args: vLLM 0.33 passes max_cache_hit_length as well.
        blocks = self.obcache_ledger.get(request.request_id)
        if blocks is None or blocks.disabled is not None:
            return super()._get_local_prefix_cache_hit(request, *args)

        def ordinary():
            return super(OBCacheScheduler, self)._get_local_prefix_cache_hit(request, *args)

        try:
            return self.obcache_prefix.lookup(request, blocks, ordinary)
        except Exception as exc:  # contained: the request computes its whole prompt itself
            reason = "injected" if isinstance(exc, InjectedFault) else type(exc).__name__
            self.obcache_totals.count_failure("adopt", reason)
            log_fault(request.request_id, "adopt", reason, str(exc),
                      "recomputed without the prefix cache")  # fmt: skip
            blocks.unadopt()  # whatever a lookup before this one adopted
            blocks.lookup = None
            return self.kv_cache_manager.empty_kv_cache_blocks, 0, 0, False

    def _preempt_request(self, request, *args, **kwargs) -> None:
        super()._preempt_request(request, *args, **kwargs)
        blocks = self.obcache_ledger.get(request.request_id)
        if blocks is not None and self.obcache_ledger.reset(request.request_id):
            # Its KV is gone; recomputed from the tokens, the budget evicts it again.
            logger.info("obcache: compressed request %s preempted (%d evictions so far): "
                        "its KV is recomputed and evicted again", request.request_id,
                        blocks.evictions)  # fmt: skip

    def _free_request(self, request, *args, **kwargs):
        blocks = self.obcache_ledger.get(request.request_id)
        if blocks is not None:
            finished = request.status in (
                RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED
            )  # fmt: skip
            if blocks.may_continue(finished):  # the session's next turn continues from here
                self.obcache_prefix.donate_blocks(request, blocks)
        self.obcache_reporter.finished(request)
        return super()._free_request(request, *args, **kwargs)

    # -- orders ------------------------------------------------------------------------------
    def schedule(self, *args, **kwargs):
        if self._obcache_refused:  # never scheduled: finished now, reported in this step
            refused, self._obcache_refused = self._obcache_refused, []
            finished = self.finish_requests(refused, RequestStatus.FINISHED_ERROR)
            self._obcache_errored.extend(finished)
        self.obcache_pool.new_step()
        output = super().schedule(*args, **kwargs)
        orders, disabled = {}, []
        for req_id in output.num_scheduled_tokens:  # values change below, keys do not
            blocks = self.obcache_ledger.get(req_id)
            if blocks is None or blocks.disabled is not None:
                continue
            try:
                order = self._plan_request(output, self.requests[req_id], blocks)
            except Exception as exc:  # contained: this request goes on uncompressed
                reason = "injected" if isinstance(exc, InjectedFault) else type(exc).__name__
                self._contain(req_id, blocks, "schedule", reason, str(exc), torn=False)
                disabled.append(req_id)
                continue
            if order is not None:
                orders[req_id] = self.obcache_prefix.with_preserved(
                    self.requests[req_id], blocks, order
                )
        for req_id, order in self.obcache_pressure.plan(output, orders).items():
            try:  # the pool is short: compress instead of letting vLLM preempt next step
                order = self.obcache_prefix.release_for_pressure(self.requests[req_id], order)
                self.obcache_pool.check_writable(req_id, order)
            except Exception as exc:  # contained: vLLM preempts as it would have
                blocks = self.obcache_ledger.get(req_id)
                self._contain(req_id, blocks, "schedule", type(exc).__name__, str(exc),
                              torn=False)  # fmt: skip
                disabled.append(req_id)
                continue
            orders[req_id] = order
        setattr(output, ORDERS_ATTR, orders)
        if disabled:
            setattr(output, DISABLED_ATTR, tuple(disabled))
        starts = self._admitted(output)
        if starts:
            setattr(output, STARTS_ATTR, starts)
        if self.obcache_verify:
            setattr(output, VERIFY_ATTR, self._verify_note(starts))
        return output

    def _admitted(self, output) -> dict[str, tuple[int, tuple | None]]:
        """This step's new or resumed budgeted requests: their lookups counted (once per
        admission), and, for those that adopted an entry, its dead blocks and per-head layout
        (None: one table for every head)."""
        starts = {}
        admitted = [new.req_id for new in output.scheduled_new_reqs]
        admitted += list(output.scheduled_cached_reqs.resumed_req_ids)
        for req_id in admitted:
            blocks = self.obcache_ledger.get(req_id)
            if blocks is None:
                continue
            self.obcache_prefix.admitted(blocks)
            if blocks.start is not None and blocks.start.compressed:
                starts[req_id] = (blocks.start.dead, blocks.start.head_layout)
        return starts

    def _verify_note(self, starts: dict[str, tuple]) -> VerifyNote:
        """What the worker's KV oracle checks this step (verification mode)."""
        entries = tuple(
            EntryNote(e.entry_id, e.donor or "?", e.tokens, e.dead, e.source_ids, e.block_ids)
            for e in self.obcache_prefix.take_made()
        )
        adopted = []
        for req_id in starts:
            start = self.obcache_ledger.get(req_id).start
            if start.entry_id is not None:
                note = AdoptNote(start.entry_id, start.donor or "?", start.tokens, start.dead)
                adopted.append((req_id, note))
        return VerifyNote(entries, tuple(adopted))

    def _plan_request(self, output, request, blocks: RequestBlocks) -> EvictionOrder | None:
        """This step's order for one budgeted request, or None (may cut its prefill chunk)."""
        point = blocks.cut_at()
        if point is not None:
            self._cut_chunk_at(output, request, point)
        order = blocks.can_compact(request.num_computed_tokens, request.is_prefill_chunk)
        if order is not None:
            self.obcache_pool.check_writable(request.request_id, order)
        return order

    @staticmethod
    def _cut_chunk_at(output, request, point: int) -> None:
        """Shorten this step's chunk of ``request`` so that it ends at token ``point``.

        Runs after ``Scheduler.schedule`` has advanced ``num_computed_tokens`` and
        ``num_in_flight_tokens`` by the scheduled count (``_update_after_schedule``); both are
        moved back together with the step's counts. Blocks allocated for the cut tokens stay
        with the request and serve its next chunk. The request remains a prefill chunk.
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

    # -- reports -----------------------------------------------------------------------------
    def update_from_output(self, scheduler_output, model_runner_output):
        orders = getattr(scheduler_output, ORDERS_ATTR, None) or {}
        report = getattr(model_runner_output, REPORT_ATTR, None)
        totals = self.obcache_totals
        torn: list[str] = []
        if report is None:
            for req_id in orders:  # the worker's report of these orders is missing
                totals.orders_not_applied += 1
                totals.count_failure("report", "missing")
                log_fault(
                    req_id, "report", "missing", "no worker report for its order",
                    "its blocks are freed once a later report shows the worker's state",
                )  # fmt: skip
        else:
            self.obcache_reporter.step_seconds(report)
            for req_id, row in report.states.items():
                request = self.requests.get(req_id)
                if req_id not in self.obcache_ledger or request is None:
                    continue
                if request.status != RequestStatus.RUNNING:
                    continue
                blocks = self.obcache_ledger.get(req_id)
                order = orders.get(req_id)
                at_point = req_id in report.applied and blocks.compressed_at_point(order)
                freed = self.obcache_ledger.commit(req_id, row)
                if freed is not None:
                    self.obcache_pool.free_head(req_id, *freed)
                if at_point and blocks.entry_kind == "compress_at":
                    self.obcache_prefix.donate_copy(request, blocks)
            for mismatch in report.mismatches:  # the KV oracle (verification mode)
                totals.count_failure("verify", mismatch.reason)
                self.obcache_mismatches.append(mismatch)
                log_fault(mismatch.req_id, "verify", mismatch.reason,
                          f"{mismatch.detail} (the other request: {mismatch.other_id})",
                          "served as it is (verification only)")  # fmt: skip
            for failure in report.failures:
                blocks = self.obcache_ledger.get(failure.req_id)
                if blocks is not None:
                    self._contain(
                        failure.req_id, blocks, failure.stage, failure.reason, "worker",
                        torn=failure.fatal,
                    )  # fmt: skip
                if failure.fatal:
                    torn.append(failure.req_id)
        applied = set(report.applied) if report is not None else set()
        for req_id, order in orders.items():
            if order.preserve:  # spare blocks: registered if compacted, released either way
                request = self.requests.get(req_id)
                self.obcache_prefix.settle_preserved(request, order, req_id in applied)
        errored, self._obcache_errored = self._obcache_errored, []
        if torn:
            errored += self.finish_requests(torn, RequestStatus.FINISHED_ERROR)
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        _report_errored(outputs, errored)
        self.obcache_reporter.attach_outcomes(outputs, self.requests)
        return outputs

    def _contain(self, req_id, blocks: RequestBlocks, stage, reason, detail, *, torn) -> None:
        """Stop evicting one request after a fault: log it with its id and count it."""
        self.obcache_totals.count_failure(stage, reason)
        blocks.disabled = f"{stage}: {reason}"
        if torn:
            self.obcache_totals.failed_requests += 1
        fate = "its cache is torn: finished with an error" if torn else "continues uncompressed"
        log_fault(req_id, stage, reason, detail, fate)

    def make_stats(self, *args, **kwargs):
        stats = super().make_stats(*args, **kwargs)
        if stats is not None:
            self.obcache_reporter.attach_stats(stats)
        return stats


class StockLayoutScheduler(Scheduler):
    """vLLM's ``Scheduler`` for a KV-cache layout budgets cannot evict in (see
    :meth:`OBCacheScheduler.__new__`). Admission refuses budgets for the models known to give
    such layouts; a budgeted request that reaches this scheduler all the same (a layout
    admission could not foresee) is a counted fault, finished with an error before it runs."""

    obcache_reason = "no KV-cache group to evict in"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._obcache_refused: list[str] = []
        self._obcache_errored: list = []

    def add_request(self, request) -> None:
        params = request.sampling_params
        try:
            budgeted = params is not None and admitted_options(params.extra_args) is not None
        except WireError:
            budgeted = True
        if budgeted:
            log_fault(request.request_id, "admission", "layout", self.obcache_reason,
                      "finished with an error before it ran")  # fmt: skip
            self._obcache_refused.append(request.request_id)
        super().add_request(request)

    def schedule(self, *args, **kwargs):
        if self._obcache_refused:
            refused, self._obcache_refused = self._obcache_refused, []
            self._obcache_errored += self.finish_requests(refused, RequestStatus.FINISHED_ERROR)
        return super().schedule(*args, **kwargs)

    def update_from_output(self, scheduler_output, model_runner_output):
        errored, self._obcache_errored = self._obcache_errored, []
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        _report_errored(outputs, errored)
        return outputs


def _report_errored(outputs, errored) -> None:
    """Requests finished with an error outside a forward pass, reported as vLLM reports its own
    per-request errors (one output with no tokens and the finish reason)."""
    for request in errored:
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
