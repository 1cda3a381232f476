"""Test-only fault injection, wrapped around the eviction path when ``OBCACHE_VLLM_FAULTS=1``.

:func:`install` (called by :func:`obcache_vllm.vllm_ext.install.install` only when the switch
is on) wraps, process-locally:

* ``OBCacheScheduler.add_request`` (note the request's ``obcache_fault``),
  ``OBCacheScheduler._plan_request`` (``schedule``: raise at its first order; ``desync``: send
  that order with a wrong length) and ``PrefixAdapter.lookup`` (``adopt``: raise where a
  request would start from the prefix cache or an entry),
* ``WorkerEviction.update_states`` (note), ``WorkerEviction.commit`` (``report``: lose the
  report of the step whose order applied; a fired fault is spent),
* the layer function the attention impls call (``score`` / ``compact:N`` through a
  :class:`~obcache_vllm.eviction.faults.FaultyView`), and the decode grouping (a faulted row is
  handled alone, where its view can raise).

Without the switch none of this is installed: the eviction path carries no fault branch.
"""

from __future__ import annotations

import dataclasses
import functools

from obcache_vllm.eviction import faults
from obcache_vllm.eviction.faults import FaultyView, InjectedFault
from obcache_vllm.vllm_ext import seams

LAYER_STAGES = ("score", "compact")
_faults = faults.Faults()  # this process's pending faults


def _wrap_add_request(original):
    @functools.wraps(original)
    def add_request(self, request):
        params = request.sampling_params
        _faults.note(request.request_id, params.extra_args if params is not None else None)
        return original(self, request)

    add_request.__obcache_wrapped__ = True
    return add_request


def _wrap_plan_request(original):
    @functools.wraps(original)
    def _plan_request(self, output, request, blocks):
        order = original(self, output, request, blocks)
        fault = _faults.peek(request.request_id, "schedule", "desync")
        if order is None or fault is None:
            return order
        _faults.fire(request.request_id)
        if fault.stage == "schedule":
            raise InjectedFault("schedule")
        return dataclasses.replace(order, logical_len=order.logical_len + 1)  # desync

    _plan_request.__obcache_wrapped__ = True
    return _plan_request


def _wrap_lookup(original):
    @functools.wraps(original)
    def lookup(self, request, blocks, ordinary):
        if _faults.peek(request.request_id, "adopt"):
            _faults.fire(request.request_id)
            raise InjectedFault("adopt")
        return original(self, request, blocks, ordinary)

    lookup.__obcache_wrapped__ = True
    return lookup


def _wrap_update_states(original):
    @functools.wraps(original)
    def update_states(self, scheduler_output, *args, **kwargs):
        for req_id in scheduler_output.finished_req_ids:
            _faults.drop(req_id)
        for new in scheduler_output.scheduled_new_reqs:
            params = new.sampling_params
            _faults.note(new.req_id, params.extra_args if params is not None else None)
        return original(self, scheduler_output, *args, **kwargs)

    update_states.__obcache_wrapped__ = True
    return update_states


def _wrap_commit(original):
    @functools.wraps(original)
    def commit(self, *args, **kwargs):
        plan = self.plan
        original(self, *args, **kwargs)
        if plan is None:
            return
        report = self.report
        for row in plan.rows:
            if row.outcome.failure is not None and _faults.peek(row.req_id, *LAYER_STAGES):
                _faults.fire(row.req_id)  # one shot
            if report is not None and row.req_id in report.applied:
                if _faults.peek(row.req_id, "report"):
                    _faults.fire(row.req_id)
                    self.report = None  # this step's report is lost

    commit.__obcache_wrapped__ = True
    return commit


def _tp_rank() -> int:
    """This worker's tensor-parallel rank (0 without TP)."""
    from vllm.distributed import get_tensor_model_parallel_rank

    try:
        return get_tensor_model_parallel_rank()
    except AssertionError:  # no TP group in this process
        return 0


def _wrap_evict(original):
    @functools.wraps(original)
    def evict_after_attention(plan, layer, query, view, geom):
        chosen = {}
        for row in plan.rows:
            fault = _faults.peek(row.req_id, *LAYER_STAGES)
            if fault is not None and fault.on_rank(_tp_rank()):
                chosen[row.row] = fault
        if chosen:
            view = FaultyView(view, plan.read_block_table, chosen, plan.layer_index.get(layer))
        return original(plan, layer, query, view, geom)

    evict_after_attention.__obcache_wrapped__ = True
    return evict_after_attention


def _wrap_grouping(original):
    @functools.wraps(original)
    def group_decode_orders(rows, batch_shared=True):
        rows, groups = original(rows, batch_shared)
        faulted = {r.req_id for r in rows if _faults.peek(r.req_id, *LAYER_STAGES)}
        if not faulted:
            return rows, groups
        kept, split = [], set()
        for group in groups:
            if any(r.req_id in faulted for r in group.rows):
                split.update(r.req_id for r in group.rows)
            else:
                kept.append(group)
        rows = tuple(dataclasses.replace(r, grouped=False) if r.req_id in split else r
                     for r in rows)  # fmt: skip
        return rows, tuple(kept)

    group_decode_orders.__obcache_wrapped__ = True
    return group_decode_orders


_HERE = "obcache_vllm.vllm_ext.fault_hooks"
_ENGINE = "obcache_vllm.vllm_ext.engine"
_WORKER = "obcache_vllm.vllm_ext.worker"
# obcache-vllm's own functions, wrapped the way the seam registry wraps vLLM's (these are not
# vLLM seams: nothing here is checked against vLLM).
HOOKS = tuple(
    seams.Seam(module, qualname, how="wrap", process="every", install=f"{_HERE}:{wrapper}",
               why="fault injection (tests only)")
    for module, qualname, wrapper in (
        (f"{_ENGINE}.scheduler", "OBCacheScheduler.add_request", "_wrap_add_request"),
        (f"{_ENGINE}.scheduler", "OBCacheScheduler._plan_request", "_wrap_plan_request"),
        (f"{_ENGINE}.prefix", "PrefixAdapter.lookup", "_wrap_lookup"),
        (f"{_WORKER}.lifecycle", "WorkerEviction.update_states", "_wrap_update_states"),
        (f"{_WORKER}.lifecycle", "WorkerEviction.commit", "_wrap_commit"),
        (f"{_WORKER}.attention", "evict_after_attention", "_wrap_evict"),
        (f"{_WORKER}.lifecycle", "_group_decode_orders", "_wrap_grouping"),
    )
)


def install() -> None:
    """Wrap the eviction path (idempotent; only called when :func:`faults.enabled`)."""
    seams.apply(serving=False, backend="any", rows=HOOKS)
