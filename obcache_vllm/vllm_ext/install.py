"""Installs obcache-vllm in a vLLM process: check, then apply the seam registry.

:func:`install` runs in every vLLM process (from the ``obcache`` general plugin) and is
idempotent. It first verifies the vLLM version and every row of the seam registry
(:data:`~obcache_vllm.vllm_ext.seams.REGISTRY`) for this process and platform; a mismatch
raises :class:`IncompatibleVllmError` and vLLM refuses to start, rather than silently
compacting KV through a changed interface. Then it applies the registry's rows
(:func:`~obcache_vllm.vllm_ext.seams.apply`): every patch is a row there, with the wrapper it
installs. What the rows do, in short:

* ``SchedulerConfig.get_scheduler_cls``: where vLLM would use its synchronous ``Scheduler``,
  use :class:`~obcache_vllm.vllm_ext.engine.scheduler.OBCacheScheduler` (EngineCore process);
  the scheduler binds its adapters to the KV-cache manager vLLM builds for it
  (:func:`~obcache_vllm.vllm_ext.seams.bind`).
* The platform's worker half: on CPU ``cpu_worker.CPUModelRunner`` ->
  :class:`~obcache_vllm.vllm_ext.worker.backends.cpu.OBCacheCPUModelRunner` and the
  ``CPU_ATTN`` backend -> ``OBCacheCPUBackend``; on CUDA ``gpu_worker.Worker.
  _make_model_runner`` builds ``OBCacheGPUModelRunner`` on the V1 path, and ``FLASH_ATTN`` ->
  ``OBCacheFlashAttnBackend``.
* ``InputProcessor.process_inputs``: the last step of admission
  (:func:`~obcache_vllm.vllm_ext.frontend.intake.admit_engine_request`): a request leaves
  the front end with its admitted options in their wire form, or is refused with a 400.
  Every decision is :mod:`obcache_vllm.admission`'s, which reads the platform adapter's
  declared capabilities and the scheduler class by name, so the front end imports neither.
* ``SchedulerStats`` gains an ``obcache`` field (every process; see :mod:`.wire`).
* vLLM's start-up check of the KV pool against ``max_model_len`` is relaxed as far as
  ``kv_prefill_evict`` makes safe (:mod:`~obcache_vllm.vllm_ext.engine.pool_check`), and
  requests that can never fit get a 400 (:func:`obcache_vllm.admission.capacity_error`).
* In the process that serves the OpenAI API (vLLM's app builder is loaded when the plugin
  starts; decided before anything is imported, so EngineCore and workers never import the
  server's modules on our behalf): the ``server`` rows (:mod:`~obcache_vllm.vllm_ext.
  frontend.server`: kv_* request fields and server defaults, ``usage.obcache``,
  ``GET /v1/obcache/config``) and the obcache Prometheus stat logger.
"""

from __future__ import annotations

import functools
import logging
import sys

from obcache_vllm.vllm_ext import seams
from obcache_vllm.vllm_ext.frontend import intake
from obcache_vllm.vllm_ext.seams import (  # noqa: F401  (re-exported: tests, adapters)
    API_SERVER_MODULE,
    ATTRIBUTES,
    SEAMS,
    STATE,
    SUPPORTED_VLLM,
    IncompatibleVllmError,
    _resolve,
    check_compatibility,
    is_server_module,
)

logger = logging.getLogger(__name__)


def _wrap_process_inputs(original):
    @functools.wraps(original)
    def process_inputs(self, *args, **kwargs):
        request = original(self, *args, **kwargs)
        intake.admit_engine_request(intake.admission_of(self), request)
        return request

    process_inputs.__obcache_wrapped__ = True
    return process_inputs


def _wrap_get_scheduler_cls(original):
    @functools.wraps(original)
    def get_scheduler_cls(self):
        cls = original(self)
        from vllm.v1.core.sched.scheduler import Scheduler

        if cls is Scheduler:
            from obcache_vllm.vllm_ext.engine.scheduler import OBCacheScheduler

            return OBCacheScheduler
        return cls

    get_scheduler_cls.__obcache_wrapped__ = True
    return get_scheduler_cls



SERVER_ROWS = tuple(r for r in seams.REGISTRY if r.process == "server")


def install_api_server() -> None:
    """The rows of the process serving the OpenAI API (idempotent); see the module docstring.

    Raises:
        obcache_vllm.config.ConfigError: the server-wide kv_* defaults are invalid.
    """
    from obcache_vllm.vllm_ext.frontend.server import server_policy

    server_policy()  # loads and validates the server defaults before anything is patched
    seams.apply(serving=True, backend="any", rows=SERVER_ROWS)


def _share_vllm_logging() -> None:
    """Log ``obcache_vllm.*`` through vLLM's handlers, at vLLM's level (idempotent).

    vLLM configures only its own ``vllm`` logger; without this our records reach Python's
    last-resort handler (warnings only, no timestamp or process prefix), so the INFO lines
    (e.g. a compressed request preempted) were lost and the fault warnings looked unlike the
    rest of the server's log. With ``VLLM_CONFIGURE_LOGGING=0`` vLLM's logger has no handler
    and nothing changes. Records still propagate (pytest's ``caplog`` sees them).
    """
    ours, theirs = logging.getLogger("obcache_vllm"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level)


def install() -> bool:
    """Check compatibility, then apply every row of the seam registry (idempotent,
    process-local).

    Returns whether this process serves the OpenAI API (and got the server rows): decided
    before anything is imported, so EngineCore and worker processes neither import nor patch
    the server's modules.
    """
    serving = API_SERVER_MODULE in sys.modules
    _share_vllm_logging()
    backend = seams.platform_backend()
    check_compatibility(include_server=serving, backend=backend)
    if serving:
        install_api_server()
    seams.apply(serving=False, backend=backend)
    from obcache_vllm.eviction import faults

    if faults.enabled():  # test-only (OBCACHE_VLLM_FAULTS=1): see fault_hooks.py
        from obcache_vllm.vllm_ext import fault_hooks

        fault_hooks.install()
    return serving
