"""vLLM general-plugin entry point of obcache-vllm.

vLLM calls every ``vllm.general_plugins`` entry point in *every* process it runs: the front-end
(API server or the ``LLM`` object's process), the EngineCore process (before the scheduler
exists) and each worker process (before the model is built). On CPU these processes are
spawned, so each one imports this module afresh. pyproject.toml declares::

    [project.entry-points."vllm.general_plugins"]
    obcache = "obcache_vllm.plugin:register"

vLLM's standard ``VLLM_PLUGINS`` filter is therefore the switch between this plugin and stock
vLLM in the same install: unset (all plugins) or ``VLLM_PLUGINS=obcache`` loads it,
``VLLM_PLUGINS=`` (empty) loads none.

Contract of :func:`register`: idempotent per process (vLLM guards its own loader, but a plugin
may still be called more than once, e.g. by tests or by another loader), never raises for a
second call, and does nothing heavy at import time. The eviction machinery (attention
backend, scheduler, model runner, request validation) is installed from here by
:func:`obcache_vllm.vllm_ext.install.install`, which first checks the vLLM version and every
internal signature it relies on and refuses to start on a mismatch.

Debugging aid: if ``OBCACHE_VLLM_PLUGIN_TRACE`` names a file, each process appends one line
``"<pid> <process-name> registered"`` on its first call (then ``"<pid> <process-name>
api-server"`` if that process got the OpenAI-server patches) and ``"<pid> duplicate"`` on later
calls.
The engine tests use it to prove the plugin is discovered and loaded once in every process.
"""

from __future__ import annotations

import os

from obcache_vllm import settings

TRACE_ENV = settings.PLUGIN_TRACE

# pid of the process that ran register(); a forked child inherits the module state but has a
# different pid, so it registers again.
_registered_pid: int | None = None


def register() -> None:
    """Entry point of the ``obcache`` general plugin (see the module docstring)."""
    global _registered_pid
    pid = os.getpid()
    if _registered_pid == pid:
        _trace(f"{pid} duplicate")
        return
    _registered_pid = pid
    from obcache_vllm.vllm_ext.install import install

    serving = install()
    _trace(f"{pid} {_process_name()} registered")
    if serving:
        _trace(f"{pid} {_process_name()} api-server")


def _process_name() -> str:
    import multiprocessing

    return multiprocessing.current_process().name.replace(" ", "_")


def _trace(line: str) -> None:
    path = settings.value(TRACE_ENV)
    if not path:
        return
    # One short append per call: O_APPEND writes of a single line do not interleave.
    with open(path, "a", encoding="utf-8") as f:
        f.write(line + "\n")
