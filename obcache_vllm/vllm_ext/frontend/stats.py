"""obcache-vllm's metrics at vLLM's ``/metrics`` (API-server process), fed from EngineCore.

Path (every metric is defined in :mod:`obcache_vllm.metrics`):

1. EngineCore: ``OBCacheScheduler.make_stats`` sets ``SchedulerStats.obcache``, a field that
   the seam registry adds to vLLM's ``SchedulerStats`` dataclass (its ``field`` row) in every
   process (the plugin runs before the first stats are encoded or decoded), so msgspec carries it
   to the front-end with the rest of the stats.
2. Front-end: :class:`OBCachePrometheusStatLogger` subclasses vLLM's ``PrometheusStatLogger``.
   vLLM's ``StatLoggerManager`` then uses it *instead of* the stock Prometheus logger (every
   stock ``vllm:`` metric is kept: ``super().__init__``/``super().record``), and our metrics are
   created after the stock constructor unregistered every ``vllm:`` collector. It is registered
   as the ``vllm.stat_logger_plugins`` entry point ``obcache``; :func:`stat_logger_factories`
   also adds it where that entry point is not installed (e.g. a source checkout).
3. Rejections happen in admission, in the API server's input processing: the live logger hands
   the front end's intake its counter (:func:`~obcache_vllm.vllm_ext.frontend.intake.
   count_rejections_with`; without a logger, e.g. the offline ``LLM``, nothing counts), so
   the intake never imports this module.

Counters are fed by deltas of EngineCore's cumulative totals, so a lost stats message loses no
count; histograms by the drained per-step lists.
"""

from __future__ import annotations

import logging

from vllm.v1.metrics.loggers import PrometheusStatLogger

from obcache_vllm import admission, metrics
from obcache_vllm.vllm_ext.frontend import intake
from obcache_vllm.vllm_ext.seams import platform_backend
from obcache_vllm.vllm_ext.wire import STATS_ATTR

logger = logging.getLogger(__name__)



def _make(spec: metrics.MetricSpec):
    from prometheus_client import Counter, Gauge, Histogram

    if spec.kind == "gauge":
        return Gauge(
            spec.name, spec.help, labelnames=list(spec.labels), multiprocess_mode="mostrecent"
        )
    if spec.kind == "counter":
        return Counter(spec.name, spec.help, labelnames=list(spec.labels))
    if spec.kind == "histogram":
        return Histogram(spec.name, spec.help, labelnames=list(spec.labels), buckets=spec.buckets)
    raise ValueError(f"unknown metric kind {spec.kind!r}")


class OBCachePrometheusStatLogger(PrometheusStatLogger):
    """vLLM's Prometheus logger plus the obcache metrics (see the module docstring)."""

    def __init__(self, vllm_config, engine_indexes: list[int] | None = None) -> None:
        super().__init__(vllm_config, engine_indexes)
        made = {spec.name: _make(spec) for spec in metrics.METRICS}
        self.obcache_evicted = made[metrics.EVICTED_TOKENS.name]
        self.obcache_freed = made[metrics.FREED_BLOCKS.name]
        self.obcache_events = made[metrics.EVICTION_EVENTS.name]
        self.obcache_seconds = made[metrics.EVICTION_SECONDS.name]
        self.obcache_resident = made[metrics.RESIDENT_TOKENS.name]
        self.obcache_kept_ratio = made[metrics.KEPT_RATIO.name]
        self.obcache_rejected = made[metrics.REJECTED_REQUESTS.name]
        self.obcache_failures = made[metrics.EVICTION_FAILURES.name]
        self.obcache_preempted = made[metrics.COMPRESSED_PREEMPTIONS.name]
        self.obcache_lookups = made[metrics.COMPRESSED_LOOKUPS.name]
        self.obcache_entries = made[metrics.COMPRESSED_ENTRIES.name]
        self.obcache_reused = made[metrics.REUSED_TOKENS.name]
        self.obcache_preserved = made[metrics.PRESERVED_BLOCKS.name]
        self.obcache_held = made[metrics.HELD_BLOCKS.name]
        self._obcache_held: dict[int, int] = {}  # engine -> its held blocks, summed
        self.obcache_pressure = [
            made[spec.name]
            for spec in (metrics.PRESSURE_COMPRESSIONS, metrics.PREEMPTIONS_AVOIDED,
                         metrics.PRESSURE_ADMISSIONS)
        ]  # fmt: skip
        # The scheduler reports cumulative totals; the last one seen per (engine, metric, labels).
        self._obcache_seen: dict[tuple, int] = {}
        rejected = self.obcache_rejected
        intake.count_rejections_with(lambda field: rejected.labels(field=field).inc())
        _announce_refusals(vllm_config)

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
        super().record(
            scheduler_stats, iteration_stats, mm_cache_stats=mm_cache_stats, engine_idx=engine_idx
        )
        payload = getattr(scheduler_stats, STATS_ATTR, None) if scheduler_stats else None
        if payload:
            self._record_obcache(payload, engine_idx or 0)

    def _advance(self, engine_idx: int, counter, total: int, **labels: str) -> None:
        """Raise ``counter{labels}`` by what the cumulative ``total`` gained since last seen."""
        key = (engine_idx, id(counter), *labels.values())
        seen = self._obcache_seen.get(key, 0)
        self._obcache_seen[key] = total
        if total > seen:
            (counter.labels(**labels) if labels else counter).inc(total - seen)

    def _record_obcache(self, payload: dict, engine_idx: int) -> None:
        for scorer, pipeline, tokens, blocks, events in payload.get("by_option", ()):
            for counter, total in ((self.obcache_evicted, tokens), (self.obcache_freed, blocks),
                                   (self.obcache_events, events)):  # fmt: skip
                self._advance(engine_idx, counter, total, scorer=scorer, pipeline=pipeline)
        for stage, reason, count in payload.get("failures", ()):
            self._advance(engine_idx, self.obcache_failures, count, stage=stage, reason=reason)
        self._advance(engine_idx, self.obcache_preempted, payload.get("compressed_preemptions", 0))
        for kind, what, count in payload.get("prefix", ()):
            if what in ("hit", "miss"):
                self._advance(engine_idx, self.obcache_lookups, count, kind=kind, result=what)
            elif what in ("created", "evicted", "released", "wanted_again"):
                self._advance(engine_idx, self.obcache_entries, count, kind=kind, event=what)
            elif what == "reused_tokens":
                self._advance(engine_idx, self.obcache_reused, count, kind=kind)
            elif what == "preserved":
                self._advance(engine_idx, self.obcache_preserved, count)
        if "held_blocks" in payload:
            self._obcache_held[engine_idx] = payload["held_blocks"]
            self.obcache_held.set(sum(self._obcache_held.values()))
        for counter, total in zip(self.obcache_pressure, payload.get("pressure", ()), strict=False):
            self._advance(engine_idx, counter, total)
        for seconds in payload.get("seconds", ()):
            self.obcache_seconds.observe(seconds)
        for resident, kept_prompt, prompt_len in payload.get("finished", ()):
            self.obcache_resident.observe(resident)
            if prompt_len > 0:
                self.obcache_kept_ratio.observe(kept_prompt / prompt_len)


def _announce_refusals(vllm_config) -> None:
    """At server start: say once if this configuration refuses budgets, and why (e.g. the V2
    model runner, with the setting that selects the V1 one)."""
    try:
        capabilities = admission.CAPABILITIES[platform_backend()]
        reason = admission.engine_refusal(vllm_config, capabilities)
    except Exception as exc:  # never keep the server from starting over a message
        reason = f"(could not be checked: {exc})"
    if reason is not None:
        logger.warning("obcache: requests with kv_budget will get HTTP 400 on this server: %s",
                       reason)  # fmt: skip


def stat_logger_factories(original):
    """Wrap vLLM's ``load_stat_logger_plugin_factories``: ensure our logger is in the list once."""

    def load_stat_logger_plugin_factories():
        factories = list(original())
        if not any(
            isinstance(f, type) and issubclass(f, OBCachePrometheusStatLogger) for f in factories
        ):
            factories.append(OBCachePrometheusStatLogger)
        return factories

    load_stat_logger_plugin_factories.__obcache_wrapped__ = True
    load_stat_logger_plugin_factories.__wrapped__ = original
    return load_stat_logger_plugin_factories
