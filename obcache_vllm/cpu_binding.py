"""``VLLM_CPU_OMP_THREADS_BIND`` for a vLLM engine that runs in the calling process.

vLLM's CPU backend applies the variable only where it spawns workers: the multiprocessing
executor sets ``OMP_NUM_THREADS`` and the affinity of each worker it starts
(``vllm/v1/executor/multiproc_executor.py``, ``OMPProcessManager.configure_omp_envs``), and
the platform switches every engine to that executor unless ``VLLM_ENABLE_V1_MULTIPROCESSING=0``
(``vllm/platforms/cpu.py``, "UniProc is not supported as it is not possible to set the OMP
environment correctly"). An engine in the calling process (``LLM`` with
``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the test suite's engines, the evidence commands, the
benchmarks' children) therefore ignores the variable and keeps torch's default, one OpenMP
thread per core, unbound. On a two-core machine with a second process at work, that second
thread spins in libgomp's barrier on a core the other process needs, and every small op waits
for it.

:func:`bind_in_process` applies the variable the way vLLM's workers do: the process keeps to
the listed cores, one torch thread each. The benchmark children call it; the test suite's
shared engine deliberately does not (tests/engine/conftest.py says why). Call it before the
engine starts: vLLM's CPU worker replaces ``torch.set_num_threads`` with a no-op once it has
initialised.
"""

from __future__ import annotations

import os

ENV = "VLLM_CPU_OMP_THREADS_BIND"
UNBOUND = ("", "auto", "all", "nobind")


def parse_cores(value: str) -> set[int] | None:
    """The cores of the first rank in a ``VLLM_CPU_OMP_THREADS_BIND`` value ("0", "0-3,6",
    "0-1|2-3": ranks are separated by "|"), or None for the values that bind nothing."""
    value = value.strip()
    if value in UNBOUND:
        return None
    cores: set[int] = set()
    for part in value.split("|")[0].split(","):
        part = part.strip()
        if not part:
            continue
        low, dash, high = part.partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise ValueError(f"{ENV}={value!r}: expected cores such as 0, 0-3 or 0,2")
        cores.update(range(int(low), int(high or low) + 1))
    if not cores:
        raise ValueError(f"{ENV}={value!r}: no cores")
    return cores


def bind_in_process(value: str | None = None) -> set[int] | None:
    """Keep this process to the cores ``value`` (default: the environment's
    ``VLLM_CPU_OMP_THREADS_BIND``) lists, with one torch thread per core; nothing for an
    unbinding value. Returns the cores."""
    cores = parse_cores(os.environ.get(ENV, "") if value is None else value)
    if cores is None:
        return None
    import torch

    os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))
    return cores
