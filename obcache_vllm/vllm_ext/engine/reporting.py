"""What EngineCore reports about eviction: per-request outcomes, engine counters, fault lines.

Read by the API server (see :mod:`obcache_vllm.vllm_ext.frontend.server` and ``.stats``):

* every ``EngineCoreOutput`` of a budgeted request carries the request's KV outcome so far in
  ``kv_transfer_params`` as ``{"obcache": {...}}`` (:data:`~obcache_vllm.vllm_ext.wire.
  OUTCOME_KEY`). That field passes from EngineCore to the front end's ``RequestOutput``
  untouched; budgeted requests are refused when a KV connector is configured, so it has no
  other user for them.
* ``make_stats`` adds ``SchedulerStats.obcache`` (a field the plugin adds: the seam
  registry's ``field`` row, see :mod:`obcache_vllm.vllm_ext.wire`): cumulative counters per
  (scorer, pipeline) and per fault, plus the eviction timings and finished requests since the
  last stats.
"""

from __future__ import annotations

import logging
from collections import deque

from obcache_vllm.eviction.ledger import BlockLedger, FinishedKvRecord
from obcache_vllm.vllm_ext.wire import OUTCOME_KEY, STATS_ATTR

logger = logging.getLogger("obcache_vllm.vllm_ext.engine.scheduler")

# Bound on what waits for the next make_stats (it runs every step when stats are on).
_PENDING_MAX = 4096


def log_fault(req_id: str, stage: str, reason: str, detail: str, fate: str) -> None:
    """The one log line of a contained eviction fault (operators grep for the request id)."""
    logger.warning(
        "obcache: eviction fault for request %s (stage=%s reason=%s): %s; %s",
        req_id, stage, reason, detail, fate,
    )  # fmt: skip


class EngineReporter:
    """Outcomes and stats of one scheduler's budgeted requests."""

    def __init__(self, ledger: BlockLedger, prefix_counts: dict, pressure, pool,
                 held=None) -> None:  # fmt: skip
        self.ledger = ledger
        self.prefix_counts = prefix_counts
        self.held = held  # () -> blocks held for compressed entries (PrefixAdapter.held_blocks)
        self.pressure = pressure  # PressureCounts
        self.pool = pool  # PoolAdapter (admissions under pressure)
        # Drained by make_stats: eviction seconds per step, finished requests.
        self._seconds: deque[float] = deque(maxlen=_PENDING_MAX)
        self._finished: deque[FinishedKvRecord] = deque(maxlen=_PENDING_MAX)
        # Outcomes of budgeted requests freed since the outputs were last attached.
        self._outcomes: dict[str, dict] = {}

    def step_seconds(self, report) -> None:
        self.ledger.totals.scoring_seconds += report.seconds
        if report.applied:
            self._seconds.append(report.seconds)

    def finished(self, request) -> None:
        """A request is freed (finished or aborted): keep its final outcome and record."""
        blocks = self.ledger.get(request.request_id)
        if blocks is None:
            return
        resident = blocks.resident(request.num_computed_tokens)
        self._outcomes[request.request_id] = blocks.outcome(resident)
        record = self.ledger.release(request.request_id, request.num_computed_tokens)
        self._finished.append(record)

    def attach_outcomes(self, outputs, requests) -> None:
        """Put each budgeted request's KV outcome on its output (see the module docstring)."""
        finished, self._outcomes = self._outcomes, {}
        if not (finished or self.ledger.requests):
            return
        for eco in outputs.values():
            for out in eco.outputs:
                if out.kv_transfer_params is not None:
                    continue
                outcome = finished.get(out.request_id)
                if outcome is None:
                    blocks = self.ledger.get(out.request_id)
                    request = requests.get(out.request_id)
                    if blocks is None or request is None:
                        continue
                    outcome = blocks.outcome(blocks.resident(request.num_computed_tokens))
                out.kv_transfer_params = {OUTCOME_KEY: outcome}

    def attach_stats(self, stats) -> None:
        totals = self.ledger.totals
        seconds = list(self._seconds)
        finished = [[r.resident_tokens, r.kept_prompt, r.prompt_len] for r in self._finished]
        self._seconds.clear()
        self._finished.clear()
        setattr(
            stats,
            STATS_ATTR,
            {
                "by_option": [[s, p, *v] for (s, p), v in totals.by_option.items()],
                "failures": [[s, r, n] for (s, r), n in totals.failures.items()],
                "compressed_preemptions": totals.compressed_preemptions,
                "seconds": seconds,
                "finished": finished,
                "prefix": [[k, w, n] for (k, w), n in self.prefix_counts.items()],
                "held_blocks": self.held() if self.held is not None else 0,
                "pressure": [
                    self.pressure.compressions,
                    self.pressure.preemptions_avoided,
                    self.pool.pressure_admissions,
                ],
            },
        )
