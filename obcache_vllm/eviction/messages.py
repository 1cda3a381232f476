"""The messages between the scheduler (EngineCore) and the worker: frozen, primitives only.

The scheduler sends one :class:`EvictionOrder` per request and step; the worker answers once
per step with an :class:`EvictionReport`. Both ride on vLLM's own step objects (see
:mod:`obcache_vllm.vllm_ext.wire`), which are pickled between the processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class EvictionOrder:
    """Scheduler -> worker, for one request in one step.

    The worker applies it in every attention layer of the step, after that layer's attention:
    it keeps ``kept`` tokens per KV head out of the ``logical_len - dead_before*bs`` resident ones
    and writes them to the logical slots ``[dead_after*bs, logical_len)``. The scheduler frees
    blocks ``[dead_before, dead_after)`` in the same step's ``update_from_output``.

    ``preserve``: ``(block index, spare block id)`` pairs: before writing its kept tokens, each
    layer copies the request's block at that logical index (stock KV the compaction is about to
    overwrite) into the spare block, which the scheduler then registers in the prefix cache.
    """

    logical_len: int
    dead_before: int
    dead_after: int
    block_size: int
    preserve: tuple[tuple[int, int], ...] = ()
    # Ordered because the KV pool was short (kv_when "pressure"): scored with the queries the
    # worker remembered (its last prompt window and this step's), whatever the step.
    pressure: bool = False
    # An error target (kv_budget {"max_error": e}): ``dead_after`` is then the most blocks that
    # may go (the floor budget's); the worker, once every layer has scored, keeps the fewest
    # whole blocks whose estimated error is at most e, and may write from ``dead_before`` up.
    max_error: float | None = None

    @property
    def write_from(self) -> int:
        """The lowest block index the worker may write for this order."""
        return self.dead_before if self.max_error is not None else self.dead_after

    @property
    def resident_before(self) -> int:
        return self.logical_len - self.dead_before * self.block_size

    @property
    def kept(self) -> int:
        return self.logical_len - self.dead_after * self.block_size

    @property
    def blocks_freed(self) -> int:
        return self.dead_after - self.dead_before

    @property
    def tokens_evicted(self) -> int:
        return self.resident_before - self.kept


@dataclass(frozen=True)
class RowState:
    """A budgeted request's cumulative eviction state as the worker holds it after a step."""

    dead: int
    evictions: int
    tokens_evicted: int
    # Prompt tokens left by the prefill eviction (None: no prefill eviction yet).
    kept_prompt: int | None = None
    # An error target's choice: (tokens kept, the estimated error of that choice).
    chosen: tuple[int, float] | None = None
    # A pipeline whose heads own their memory, once laid out per head: its layout's wire
    # form (``HeadLayout.to_wire``), which a session entry carries to the next turn.
    head_layout: tuple | None = None


@dataclass(frozen=True)
class RowFailure:
    """A fault contained to one request. ``fatal``: its cache is torn (some layers compacted,
    others not), so the request must be finished with an error; otherwise it goes on
    uncompressed. ``stage`` and ``reason`` label the failure counter."""

    req_id: str
    stage: str
    reason: str
    fatal: bool = False


@dataclass(frozen=True)
class EvictionReport:
    """Worker -> scheduler, once per step with budgeted requests.

    ``states`` holds the cumulative state of every budgeted request of the step, so the
    scheduler can reconcile even after a lost report (it frees the dead blocks it has not freed
    yet). ``applied``: the requests whose order of this step every attention layer applied.
    ``mismatches``: what the KV oracle found this step (verification mode only,
    :class:`obcache_vllm.eviction.oracle.KvMismatch`).
    """

    applied: tuple[str, ...]
    seconds: float
    states: dict[str, RowState] = field(default_factory=dict)
    failures: tuple[RowFailure, ...] = ()
    mismatches: tuple = ()
