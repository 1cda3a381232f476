"""Scheduler-side records of eviction: per-request state, finished records, engine totals.

Plain dataclasses (no vLLM import) used by :class:`~obcache_vllm.vllm_ext.engine.scheduler.
OBCacheScheduler`; the lifecycle of :class:`SchedKvState` is the request's in the scheduler:
created on add, reset on preemption, dropped on finish.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from obcache_vllm.eviction import faults
from obcache_vllm.options import KvOptions

logger = logging.getLogger("obcache_vllm.vllm_ext.engine.scheduler")


def log_fault(req_id: str, stage: str, reason: str, detail: str, fate: str) -> None:
    """The one log line of a contained eviction fault (operators grep for the request id)."""
    logger.warning(
        "obcache: eviction fault for request %s (stage=%s reason=%s): %s; %s",
        req_id, stage, reason, detail, fate,
    )  # fmt: skip


class BlockNotWritableError(RuntimeError):
    """A block that would receive kept tokens is shared or in the prefix cache."""




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
    # Why eviction stopped for this request ("stage: reason"); it then runs uncompressed.
    disabled: str | None = None
    fault: faults.Fault | None = None  # test-only (faults.py)

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
            **({"fault": self.disabled} if self.disabled is not None else {}),
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
    # Contained faults: (stage, reason) -> count (vllm:obcache_eviction_failures_total).
    failures: dict[tuple[str, str], int] = field(default_factory=dict)
    # Requests finished with an error because their cache was torn.
    failed_requests: int = 0
    # Preemptions of requests that had evicted (vllm:obcache_compressed_preemptions_total).
    compressed_preemptions: int = 0
