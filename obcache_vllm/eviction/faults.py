"""Test-only fault injection into the eviction path (off unless ``OBCACHE_VLLM_FAULTS=1``).

The fault-injection tests and the soak prove, on the real engine, that a fault inside eviction
degrades only the request it hits. A request asks for a fault with the extra argument
``obcache_fault`` (``vllm_xargs`` over HTTP); it is honoured only when the process was started
with ``OBCACHE_VLLM_FAULTS=1`` (read once, the first time any process asks). Without the
variable the argument is ignored like any unknown extra argument, so no client can inject
faults into a production server.

==================  ===========================================================================
``obcache_fault``   what happens (once per request)
==================  ===========================================================================
``schedule``        the scheduler raises while planning the request's eviction order
``desync``          the scheduler sends an order whose length does not match the worker's view
``score``           the worker raises while scoring the request (first layer that scores it)
``compact:N``       the worker raises in layer ``N``'s compaction, after layers ``0..N-1``
                    wrote their kept tokens (the request's cache is then torn)
``report``          the worker's report of the step where the request's order applied is lost
==================  ===========================================================================
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

FAULTS_ENV = "OBCACHE_VLLM_FAULTS"
FAULT_ARG = "obcache_fault"
STAGES = ("schedule", "desync", "score", "compact", "report")


class InjectedFault(RuntimeError):
    """Raised where a test asked for a fault; contained like any other eviction fault."""


@dataclass(frozen=True)
class Fault:
    stage: str
    layer: int = 0  # compact: the layer index that raises


@functools.cache
def enabled() -> bool:
    """Whether this process honours ``obcache_fault`` (the environment, read once)."""
    return os.environ.get(FAULTS_ENV) == "1"


def requested(extra_args: Mapping[str, Any] | None) -> Fault | None:
    """The fault a request asks for, or None (always None unless :func:`enabled`)."""
    if not extra_args or FAULT_ARG not in extra_args or not enabled():
        return None
    spec = str(extra_args[FAULT_ARG])
    stage, _, arg = spec.partition(":")
    if stage not in STAGES or (arg and not arg.isdigit()):
        logger.error("ignoring %s=%r; known stages: %s", FAULT_ARG, spec, ", ".join(STAGES))
        return None
    return Fault(stage, int(arg) if arg else 0)
