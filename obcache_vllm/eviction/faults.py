"""Test-only fault injection into the eviction path (off unless ``OBCACHE_VLLM_FAULTS=1``).

The fault-injection tests and the soak prove, on the real engine, that a fault inside eviction
degrades only the request it hits. A request asks for a fault with the extra argument
``obcache_fault`` (``vllm_xargs`` over HTTP); it is honoured only when the process was started
with ``OBCACHE_VLLM_FAULTS=1`` (read once per process). Without the variable nothing of this
module is installed: the eviction path has no fault branch, and the argument is ignored like
any unknown extra argument, so no client can inject faults into a production server.

==================  ===========================================================================
``obcache_fault``   what happens (once per request)
==================  ===========================================================================
``schedule``        the scheduler raises while planning the request's eviction order
``desync``          the scheduler sends an order whose length does not match the worker's view
``score``           the worker raises while scoring the request (first layer that scores it)
``compact:N``       the worker raises in layer ``N``'s compaction, after layers ``0..N-1``
                    wrote their kept tokens (the request's cache is then torn)
``report``          the worker's report of the step where the request's order applied is lost
``adopt``           the scheduler raises while a request adopts a cached compressed context
==================  ===========================================================================

A worker stage (``score``, ``compact:N``) may name one tensor-parallel rank, ``score@1`` or
``compact:5@2``: only that rank raises, which is how a fault on one rank is tested.

How they are injected: :mod:`obcache_vllm.vllm_ext.fault_hooks` wraps the scheduler's order
planning, the runner's commit and the layer function with the pieces below (pure Python and
torch, so the layer half is unit-tested on plain tensors too).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from obcache_vllm import settings

logger = logging.getLogger(__name__)

FAULTS_ENV = settings.FAULTS
FAULT_ARG = "obcache_fault"
STAGES = ("schedule", "desync", "score", "compact", "report", "adopt")


class InjectedFault(RuntimeError):
    """Raised where a test asked for a fault; contained like any other eviction fault."""

    fault_reason = "injected"  # the reason label of the failure counter


@dataclass(frozen=True)
class Fault:
    stage: str
    layer: int = 0  # compact: the layer index that raises
    rank: int | None = None  # score / compact: only this tensor-parallel rank raises

    def on_rank(self, rank: int) -> bool:
        return self.rank is None or self.rank == rank


@functools.cache
def enabled() -> bool:
    """Whether this process honours ``obcache_fault`` (the environment, read once)."""
    return settings.flag(FAULTS_ENV)


def requested(extra_args: Mapping[str, Any] | None) -> Fault | None:
    """The fault a request asks for, or None (always None unless :func:`enabled`)."""
    if not extra_args or FAULT_ARG not in extra_args or not enabled():
        return None
    spec = str(extra_args[FAULT_ARG])
    head, at, rank = spec.partition("@")
    stage, _, arg = head.partition(":")
    if (stage not in STAGES or (arg and not arg.isdigit())
            or (at and (not rank.isdigit() or stage not in ("score", "compact")))):  # fmt: skip
        logger.error("ignoring %s=%r; known stages: %s", FAULT_ARG, spec, ", ".join(STAGES))
        return None
    return Fault(stage, int(arg) if arg else 0, int(rank) if rank else None)


class Faults:
    """The pending faults of one process's requests, each fired once."""

    def __init__(self) -> None:
        self._pending: dict[str, Fault] = {}

    def note(self, req_id: str, extra_args: Mapping[str, Any] | None) -> None:
        fault = requested(extra_args)
        if fault is None:
            self._pending.pop(req_id, None)
        else:
            self._pending[req_id] = fault

    def peek(self, req_id: str, *stages: str) -> Fault | None:
        fault = self._pending.get(req_id)
        return fault if fault is not None and fault.stage in stages else None

    def fire(self, req_id: str) -> None:
        self._pending.pop(req_id, None)

    def drop(self, req_id: str) -> None:
        self._pending.pop(req_id, None)


class FaultyView:
    """A :class:`~obcache_vllm.eviction.layer.KvCacheView` that raises for chosen rows.

    ``faults`` maps a row of ``table`` (the step's read block table) to its fault: ``score``
    raises in ``gather`` (scoring reads the resident K/V first), ``compact`` raises in
    ``scatter`` of layer ``fault.layer`` (after the row started writing that layer). A row is
    recognised by its block-table row: the core passes slices of ``table``.
    """

    def __init__(self, view, table, faults: dict[int, Fault], layer_index: int | None) -> None:
        self._view = view
        self._table = table
        self._faults = faults
        self._layer = layer_index
        self.block_size = view.block_size

    def _row_of(self, blocks) -> int | None:
        if self._table is None or self._table.numel() == 0:
            return None
        start = self._table.data_ptr()
        stride = self._table.stride(0) * self._table.element_size()
        offset = blocks.data_ptr() - start
        if offset < 0 or blocks.shape[0] != 1:
            return None
        return offset // stride

    _last: int | None = None  # the row of the last gather (a head-block write names no row)

    def gather(self, blocks, num_tokens):
        self._last = self._row_of(blocks)
        fault = self._faults.get(self._last)
        if fault is not None and fault.stage == "score":
            raise InjectedFault("score")
        return self._view.gather(blocks, num_tokens)

    def scatter(self, blocks, keys, values) -> None:
        fault = self._faults.get(self._row_of(blocks))
        if fault is not None and fault.stage == "compact" and fault.layer == self._layer:
            raise InjectedFault(f"compact at layer {fault.layer}")
        self._view.scatter(blocks, keys, values)

    def scatter_head_blocks(self, ids, keys, values) -> None:
        """Per-head memory: the row is the one whose K/V this layer gathered last (the
        compaction gathers its resident K/V right before it writes)."""
        fault = self._faults.get(self._last)
        if fault is not None and fault.stage == "compact" and fault.layer == self._layer:
            raise InjectedFault(f"compact at layer {fault.layer}")
        self._view.scatter_head_blocks(ids, keys, values)

    def __getattr__(self, name):  # anything else a backend's view offers
        return getattr(self._view, name)
