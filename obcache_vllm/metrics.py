"""The Prometheus metrics obcache-vllm adds to vLLM's ``/metrics``: names, help, labels, buckets.

The single definition of every metric (the README table is checked against it by
``tests/unit/test_metrics_table.py``). The vLLM adapter that creates and feeds them lives in
:mod:`obcache_vllm.vllm_ext.frontend.stats`. No vLLM import.

Counters are declared without the ``_total`` suffix, as ``prometheus_client`` expects; the
exposed sample name is :meth:`MetricSpec.exposed`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MetricSpec:
    name: str
    kind: str  # "counter" | "histogram" | "gauge"
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None

    @property
    def exposed(self) -> str:
        """The sample name at ``/metrics`` (counters get ``_total``, histograms ``_bucket``...)."""
        return f"{self.name}_total" if self.kind == "counter" else self.name


EVICTED_TOKENS = MetricSpec(
    "vllm:obcache_evicted_tokens",
    "counter",
    "KV tokens evicted (per layer and KV head) by obcache-vllm, by scorer and pipeline.",
    ("scorer", "pipeline"),
)
FREED_BLOCKS = MetricSpec(
    "vllm:obcache_freed_blocks",
    "counter",
    "KV-cache blocks returned to vLLM's pool by eviction, by scorer and pipeline.",
    ("scorer", "pipeline"),
)
EVICTION_EVENTS = MetricSpec(
    "vllm:obcache_eviction_events",
    "counter",
    "Evictions applied (one per request per prefill or decode eviction), by scorer and pipeline.",
    ("scorer", "pipeline"),
)
EVICTION_SECONDS = MetricSpec(
    "vllm:obcache_eviction_seconds",
    "histogram",
    "Worker time spent scoring and compacting KV per engine step that evicted (seconds).",
    (),
    (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)
RESIDENT_TOKENS = MetricSpec(
    "vllm:obcache_resident_tokens",
    "histogram",
    "KV tokens resident (per layer and KV head) when a budgeted request finished.",
    (),
    (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768),
)
KEPT_RATIO = MetricSpec(
    "vllm:obcache_kept_prompt_ratio",
    "histogram",
    "Prompt tokens kept by prefill eviction divided by prompt tokens, per finished budgeted "
    "request.",
    (),
    (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0),
)
REJECTED_REQUESTS = MetricSpec(
    "vllm:obcache_rejected_requests",
    "counter",
    "Requests rejected (HTTP 400) for an invalid kv_* option, by the offending field.",
    ("field",),
)

EVICTION_FAILURES = MetricSpec(
    "vllm:obcache_eviction_failures",
    "counter",
    "Eviction faults contained to one request, by stage (schedule, score, compact, report; "
    "verify: a KV oracle mismatch, OBCACHE_VLLM_VERIFY=1) and reason; that request continued "
    "uncompressed or finished with an error (verify: served as it was).",
    ("stage", "reason"),
)

COMPRESSED_PREEMPTIONS = MetricSpec(
    "vllm:obcache_compressed_preemptions",
    "counter",
    "Budgeted requests preempted after an eviction: vLLM frees their blocks and recomputes "
    "their KV from the tokens, and the budget evicts again.",
)

COMPRESSED_LOOKUPS = MetricSpec(
    "vllm:obcache_compressed_lookups",
    "counter",
    "Budgeted requests that looked for a cached compressed context (kv_compress_at, kv_session) "
    "and found one (result=hit, it was adopted) or not (result=miss), by kind.",
    ("kind", "result"),
)
COMPRESSED_ENTRIES = MetricSpec(
    "vllm:obcache_compressed_entries",
    "counter",
    "Compressed contexts left in the prefix cache (event=created), gone again under the "
    "pool's LRU, the index bound or a replacement (event=evicted), and no longer held out of "
    "the LRU because a request needed the blocks or the held share was full (event=released), "
    "and found gone by a request that wanted it (event=wanted_again: released, then its blocks "
    "reused), by kind.",
    ("kind", "event"),
)
REUSED_TOKENS = MetricSpec(
    "vllm:obcache_reused_tokens",
    "counter",
    "Prompt tokens not recomputed because a request adopted a compressed context, by kind.",
    ("kind",),
)
PRESERVED_BLOCKS = MetricSpec(
    "vllm:obcache_preserved_blocks",
    "counter",
    "Blocks of stock KV copied aside before a compaction overwrote them and registered in the "
    "prefix cache (so later requests read the whole prompt).",
)

HELD_BLOCKS = MetricSpec(
    "vllm:obcache_held_blocks",
    "gauge",
    "KV-cache blocks that compressed contexts hold out of vLLM's LRU (counted as used in "
    "vllm:kv_cache_usage_perc; bounded by OBCACHE_ENTRY_POOL_SHARE_MAX of the pool, given up "
    "before any request is preempted for them, and above OBCACHE_ENTRY_POOL_SHARE to a request "
    "waiting for blocks).",
)

PRESSURE_COMPRESSIONS = MetricSpec(
    "vllm:obcache_pressure_compressions",
    "counter",
    "Compressions of kv_when=pressure requests ordered because the KV pool was short (the next "
    "step would have preempted a request or left a waiting one unadmitted).",
)
PREEMPTIONS_AVOIDED = MetricSpec(
    "vllm:obcache_preemptions_avoided",
    "counter",
    "Steps whose predicted shortfall of blocks for the running requests was covered by "
    "compression under pressure instead of preemption.",
)
PRESSURE_ADMISSIONS = MetricSpec(
    "vllm:obcache_pressure_admissions",
    "counter",
    "kv_when=pressure requests admitted because their compressed footprint fit the KV pool "
    "while their whole prompt did not (evicted while prefilled).",
)

METRICS: tuple[MetricSpec, ...] = (
    EVICTED_TOKENS,
    FREED_BLOCKS,
    EVICTION_EVENTS,
    EVICTION_SECONDS,
    RESIDENT_TOKENS,
    KEPT_RATIO,
    REJECTED_REQUESTS,
    EVICTION_FAILURES,
    COMPRESSED_PREEMPTIONS,
    COMPRESSED_LOOKUPS,
    COMPRESSED_ENTRIES,
    REUSED_TOKENS,
    PRESERVED_BLOCKS,
    HELD_BLOCKS,
    PRESSURE_COMPRESSIONS,
    PREEMPTIONS_AVOIDED,
    PRESSURE_ADMISSIONS,
)
