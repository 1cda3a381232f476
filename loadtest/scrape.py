"""Server-side figures from ``/metrics`` during a run: a timeline and before/after counters.

Parsed with ``prometheus_client``'s own text parser. A :class:`Snapshot` keeps every sample
(name and labels -> value); the timeline keeps the few series the report plots. Counters are
compared as increases between the snapshot taken before the first request and the one taken
after the server went idle (:func:`increase`). Servers without a series (stock vLLM has no
``vllm:obcache_*``) simply read 0.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from obcache_vllm import metrics as M

KV_USAGE = "vllm:kv_cache_usage_perc"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
PREEMPTIONS = "vllm:num_preemptions_total"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"
REQUEST_SUCCESS = "vllm:request_success_total"  # label finished_reason (abort included)
# Ours, named by their single definition (a renamed metric must not silently read 0 here).
EVICTED_TOKENS = M.EVICTED_TOKENS.exposed
FREED_BLOCKS = M.FREED_BLOCKS.exposed
EVICTION_EVENTS = M.EVICTION_EVENTS.exposed
REJECTED = M.REJECTED_REQUESTS.exposed
FAILURES = M.EVICTION_FAILURES.exposed
COMPRESSED_PREEMPTIONS = M.COMPRESSED_PREEMPTIONS.exposed
PRESSURE_COMPRESSIONS = M.PRESSURE_COMPRESSIONS.exposed
PREEMPTIONS_AVOIDED = M.PREEMPTIONS_AVOIDED.exposed
PRESSURE_ADMISSIONS = M.PRESSURE_ADMISSIONS.exposed
REUSED_TOKENS = M.REUSED_TOKENS.exposed
HELD_BLOCKS = M.HELD_BLOCKS.exposed
CACHE_CONFIG = "vllm:cache_config_info"  # label num_gpu_blocks

LabelKey = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Snapshot:
    """Every sample of one scrape: (name, sorted labels) -> value, and when it was taken."""

    t: float
    samples: dict[tuple[str, LabelKey], float]

    @classmethod
    def parse(cls, text: str, t: float) -> Snapshot:
        samples = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return cls(t, samples)

    def value(self, name: str, **labels: str) -> float:
        """Sum of ``name``'s samples whose labels include ``labels`` (0 when there is none)."""
        want = set(labels.items())
        return sum(v for (n, key), v in self.samples.items() if n == name and want <= set(key))

    def unheld_kv_usage(self) -> float:
        """``vllm:kv_cache_usage_perc`` less the blocks compressed contexts hold out of the LRU
        (:data:`HELD_BLOCKS`; vLLM counts them as used, no request holds them): 0 on an idle
        server. Without the pool size in ``vllm:cache_config_info`` the usage as it is."""
        usage, held = self.value(KV_USAGE), self.value(HELD_BLOCKS)
        if not held:
            return usage
        sizes = [dict(key).get("num_gpu_blocks") for n, key in self.samples if n == CACHE_CONFIG]
        sizes = [int(v) for v in sizes if v and v.isdigit()]
        if not sizes or sizes[0] <= 1:
            return usage
        unheld = usage - held / (sizes[0] - 1)  # vLLM's usage leaves out the null block
        return unheld if unheld > 1e-9 else 0.0  # vLLM computes 1 - free / total in floats

    def names(self) -> set[str]:
        """Every sample name of the scrape (``_total``, ``_bucket``... included)."""
        return {n for n, _ in self.samples}

    def by_label(self, name: str, label: str) -> dict[str, float]:
        """``name`` summed per value of ``label``."""
        out: dict[str, float] = {}
        for (n, key), v in self.samples.items():
            if n == name:
                lv = dict(key).get(label, "")
                out[lv] = out.get(lv, 0.0) + v
        return out


def increase(before: Snapshot, after: Snapshot, name: str, **labels: str) -> float:
    """Counter increase of ``name`` (summed over matching labels) between two snapshots."""
    return after.value(name, **labels) - before.value(name, **labels)


def increase_by_label(before: Snapshot, after: Snapshot, name: str, label: str) -> dict:
    a, b = after.by_label(name, label), before.by_label(name, label)
    return {k: a[k] - b.get(k, 0.0) for k in sorted(a) if a[k] - b.get(k, 0.0)}


@dataclass
class Timeline:
    """Gauges and eviction counters over the run, one point per scrape."""

    t: list[float] = field(default_factory=list)  # seconds since the run started
    kv_usage: list[float] = field(default_factory=list)
    running: list[float] = field(default_factory=list)
    waiting: list[float] = field(default_factory=list)
    evicted_tokens: list[float] = field(default_factory=list)  # cumulative, from run start
    preemptions: list[float] = field(default_factory=list)  # cumulative, from run start
    errors: int = 0  # failed scrapes

    def add(self, snap: Snapshot, start: float, base: Snapshot) -> None:
        self.t.append(round(snap.t - start, 3))
        self.kv_usage.append(snap.value(KV_USAGE))
        self.running.append(snap.value(RUNNING))
        self.waiting.append(snap.value(WAITING))
        self.evicted_tokens.append(increase(base, snap, EVICTED_TOKENS))
        self.preemptions.append(increase(base, snap, PREEMPTIONS))

    def summary(self) -> dict[str, float]:
        n = len(self.t) or 1
        return {
            "scrapes": len(self.t),
            "failed_scrapes": self.errors,
            "kv_usage_mean": sum(self.kv_usage) / n,
            "kv_usage_max": max(self.kv_usage, default=0.0),
            "running_mean": sum(self.running) / n,
            "running_max": max(self.running, default=0.0),
            "waiting_max": max(self.waiting, default=0.0),
        }


async def scrape(session: aiohttp.ClientSession, base_url: str) -> Snapshot:
    """One GET /metrics."""
    async with session.get(base_url.rstrip("/") + "/metrics") as resp:
        resp.raise_for_status()
        text = await resp.text()
    return Snapshot.parse(text, time.perf_counter())


async def poll(
    session: aiohttp.ClientSession,
    base_url: str,
    timeline: Timeline,
    start: float,
    base: Snapshot,
    interval_s: float,
    stop: asyncio.Event,
) -> None:
    """Scrape every ``interval_s`` into ``timeline`` until ``stop`` is set."""
    while not stop.is_set():
        try:
            timeline.add(await scrape(session, base_url), start, base)
        except (aiohttp.ClientError, OSError, ValueError):
            timeline.errors += 1
        try:
            await asyncio.wait_for(stop.wait(), timeout=interval_s)
        except TimeoutError:
            pass
