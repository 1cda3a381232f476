"""The stat logger turns the scheduler's cumulative totals into counter increments.

The scheduler reports running totals every step (per engine; labelled by scorer/pipeline or
stage/reason); the logger must add only what each total gained since it was last seen, per
engine and label set, so a total repeated over many steps is counted once.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from obcache_vllm.vllm_ext.frontend.stats import OBCachePrometheusStatLogger


def _logger(registry: CollectorRegistry) -> OBCachePrometheusStatLogger:
    # Only the obcache half: vLLM's own __init__ needs a whole VllmConfig.
    log = OBCachePrometheusStatLogger.__new__(OBCachePrometheusStatLogger)
    option, fault = ["scorer", "pipeline"], ["stage", "reason"]
    log.obcache_evicted = Counter("evicted", "", option, registry=registry)
    log.obcache_freed = Counter("freed", "", option, registry=registry)
    log.obcache_events = Counter("events", "", option, registry=registry)
    log.obcache_failures = Counter("failures", "", fault, registry=registry)
    log.obcache_preempted = Counter("preempted", "", registry=registry)
    log.obcache_lookups = Counter("lookups", "", ["kind", "result"], registry=registry)
    log.obcache_entries = Counter("entries", "", ["kind", "event"], registry=registry)
    log.obcache_reused = Counter("reused", "", ["kind"], registry=registry)
    log.obcache_preserved = Counter("preserved", "", registry=registry)
    log.obcache_held = Gauge("held", "", registry=registry)
    log._obcache_held = {}
    log.obcache_pressure = [Counter(n, "", registry=registry)
                            for n in ("compressions", "avoided", "admissions")]  # fmt: skip
    for name in ("obcache_seconds", "obcache_resident", "obcache_kept_ratio"):
        setattr(log, name, Histogram(name, "", registry=registry))
    log._obcache_seen = {}
    return log


def _value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(f"{name}_total", labels) or 0.0


def test_cumulative_totals_are_counted_once_per_engine_and_label_set() -> None:
    registry = CollectorRegistry()
    log = _logger(registry)
    first = {"by_option": [["obcache_key", "tova", 10, 2, 1]],
             "failures": [["score", "injected", 1]], "compressed_preemptions": 1,
             "held_blocks": 6}
    later = {"by_option": [["obcache_key", "tova", 30, 5, 2], ["attn", "h2o", 4, 1, 1]],
             "failures": [["score", "injected", 1]], "compressed_preemptions": 3,
             "prefix": [["session", "hit", 2], ["session", "miss", 1], ["session", "created", 3],
                        ["session", "reused_tokens", 900], ["stock", "preserved", 5],
                        ["compress_at", "released", 2]],
             "pressure": [4, 2, 1], "held_blocks": 4}  # fmt: skip
    for payload in (first, first, later, later):  # totals repeat across steps
        log._record_obcache(payload, engine_idx=0)
    log._record_obcache(first, engine_idx=1)  # another engine's totals are its own
    key = {"scorer": "obcache_key", "pipeline": "tova"}
    assert _value(registry, "evicted", **key) == 30 + 10
    assert _value(registry, "freed", **key) == 5 + 2
    assert _value(registry, "events", **key) == 2 + 1
    assert _value(registry, "evicted", scorer="attn", pipeline="h2o") == 4
    assert _value(registry, "failures", stage="score", reason="injected") == 1 + 1
    assert _value(registry, "preempted") == 3 + 1
    assert _value(registry, "lookups", kind="session", result="hit") == 2
    assert _value(registry, "lookups", kind="session", result="miss") == 1
    assert _value(registry, "entries", kind="session", event="created") == 3
    assert _value(registry, "reused", kind="session") == 900
    assert _value(registry, "preserved") == 5
    assert _value(registry, "entries", kind="compress_at", event="released") == 2
    assert registry.get_sample_value("held") == 4 + 6  # a gauge: each engine's latest, summed
    assert [_value(registry, n) for n in ("compressions", "avoided", "admissions")] == [4, 2, 1]
