"""Where obcache-vllm's messages ride on vLLM's own objects between processes.

Per-step state travels on the step's objects, the way vLLM passes its own (no globals):

==============================================  ===========================================
attribute                                       what
==============================================  ===========================================
``SchedulerOutput.obcache_orders``              ``{req_id: EvictionOrder}`` of the step
``SchedulerOutput.obcache_disabled``            requests whose eviction the scheduler stopped
``SchedulerOutput.obcache_starts``              ``{req_id: (dead, layout)}``: a new or resumed
                                                request whose cache starts from a compressed
                                                entry (layout: a per-head one, or None)
``SchedulerOutput.obcache_verify``              the KV oracle's checks of the step (entries
                                                made, adoptions; verification mode only)
``ModelRunnerOutput.obcache_report``            the worker's :class:`EvictionReport`
``EngineCoreOutput.kv_transfer_params``         ``{"obcache": outcome}`` of a budgeted request
``SchedulerStats.obcache``                      the engine's eviction counters (a field added
                                                to vLLM's dataclass, see below)
``SamplingParams.extra_args["obcache"]``        the admitted options (see
                                                :mod:`obcache_vllm.options`)
==============================================  ===========================================

``SchedulerOutput`` and ``ModelRunnerOutput`` are pickled between EngineCore and the worker,
and pickling keeps instance attributes. ``SchedulerStats`` is encoded with msgspec, which
drops unknown attributes: the seam registry adds a real field (its ``field`` row on
``SchedulerStats``, applied in every process by :func:`obcache_vllm.vllm_ext.seams.apply`).
"""

from __future__ import annotations

# Extra attributes carrying the messages: on SchedulerOutput (orders, dict req_id -> order) and
# on ModelRunnerOutput (report). Both objects are pickled between EngineCore and worker
# processes, and pickling keeps instance attributes.
ORDERS_ATTR = "obcache_orders"
REPORT_ATTR = "obcache_report"
# On SchedulerOutput: requests whose eviction the scheduler stopped (the worker stops scoring).
DISABLED_ATTR = "obcache_disabled"
# On SchedulerOutput: dead head blocks of requests that start from a compressed entry.
STARTS_ATTR = "obcache_starts"
# On SchedulerOutput, in verification mode only: the KV oracle's VerifyNote of the step.
VERIFY_ATTR = "obcache_verify"
# EngineCoreOutput.kv_transfer_params key carrying a budgeted request's KV outcome to the
# front-end, and the SchedulerStats field carrying the eviction counters (see vllm_ext).
OUTCOME_KEY = "obcache"
STATS_ATTR = "obcache"
