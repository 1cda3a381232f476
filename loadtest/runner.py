"""Drive one scenario against one server: issue the plan, scrape ``/metrics``, wait for idle.

Flow of :func:`run`::

    GET /v1/models, /v1/obcache/config      model name, max_model_len, plugin defaults (or none)
    GET /metrics                            snapshot "before"
    issue the plan                          concurrency: a closed loop of C clients;
      + poll /metrics every interval        rate: Poisson arrivals (capped in flight)
    deadline (duration_s)                   stop sending, cancel what is still in flight
    GET /metrics until idle                 kv_cache_usage_perc 0, nothing running or waiting
    GET /metrics                            snapshot "after" (counter increases = after - before)
    GET /health

Bounded: never more than ``scenario.requests`` requests, never longer than ``duration_s`` plus
the idle wait (``checks.idle_timeout_s``). The benchmark duration is measured as
``vllm bench serve`` does: from the first request to the end of the last one.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import aiohttp
from tqdm import tqdm

from loadtest import scrape
from loadtest.client import CATEGORIES, Outcome, send
from loadtest.scenario import RequestPlan, Scenario


@dataclass
class RunResult:
    """Everything one run observed; :mod:`loadtest.report` turns it into figures and checks."""

    scenario: Scenario
    label: str
    base_url: str
    model: str
    max_model_len: int | None
    obcache_defaults: dict[str, Any] | None  # None: the server has no obcache plugin
    planned: int
    outcomes: list[Outcome]
    started_at: str
    duration_s: float
    stopped_by: str  # "count" or "deadline"
    before: scrape.Snapshot
    after: scrape.Snapshot
    timeline: scrape.Timeline
    idle: bool
    idle_wait_s: float
    healthy: bool


async def _get_json(session: aiohttp.ClientSession, url: str) -> dict | None:
    try:
        async with session.get(url) as resp:
            return await resp.json() if resp.status == 200 else None
    except (aiohttp.ClientError, OSError, ValueError):
        return None


async def _healthy(session: aiohttp.ClientSession, base_url: str) -> bool:
    try:
        async with session.get(base_url.rstrip("/") + "/health") as resp:
            return resp.status == 200
    except (aiohttp.ClientError, OSError):
        return False


async def _wait_idle(
    session: aiohttp.ClientSession, base_url: str, timeout_s: float, every_s: float
) -> tuple[bool, float]:
    """Poll /metrics until no request holds a KV block and nothing runs or waits (blocks held
    for compressed contexts are not a request's: :meth:`scrape.Snapshot.unheld_kv_usage`)."""
    start = time.perf_counter()
    while True:
        try:
            snap = await scrape.scrape(session, base_url)
            if (
                snap.unheld_kv_usage() == 0
                and snap.value(scrape.RUNNING) == 0
                and snap.value(scrape.WAITING) == 0
            ):
                return True, time.perf_counter() - start
        except (aiohttp.ClientError, OSError, ValueError):
            pass
        if time.perf_counter() - start > timeout_s:
            return False, time.perf_counter() - start
        await asyncio.sleep(every_s)


class _Progress:
    """tqdm bar over finished requests, with the outcome counts as postfix."""

    def __init__(self, total: int, desc: str, enabled: bool) -> None:
        self.bar = tqdm(total=total, desc=desc, unit="req", disable=not enabled, leave=True)
        self.counts = dict.fromkeys(CATEGORIES, 0)

    def done(self, outcome: Outcome) -> None:
        self.counts[outcome.category] += 1
        self.bar.set_postfix({k: v for k, v in self.counts.items() if v}, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


async def _issue(
    scenario: Scenario,
    plans: list[RequestPlan],
    one,
    tasks: list[asyncio.Task],
) -> None:
    """Create one task per plan, paced by the scenario's load; return when all have finished."""
    if scenario.load.concurrency is not None:
        slots = asyncio.Semaphore(scenario.load.concurrency)
        arrivals = None
    else:
        slots = asyncio.Semaphore(scenario.load.max_in_flight)
        rng = random.Random(scenario.seed + 1)
        t, arrivals = 0.0, []
        for _ in plans:
            t += rng.expovariate(scenario.load.rate)
            arrivals.append(t)
    start = time.perf_counter()
    for i, plan in enumerate(plans):
        if arrivals is not None:
            delay = arrivals[i] - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
        await slots.acquire()
        task = asyncio.create_task(one(plan))
        task.add_done_callback(lambda _t: slots.release())
        tasks.append(task)
    await asyncio.gather(*tasks)


async def run(
    scenario: Scenario,
    plans: list[RequestPlan],
    base_url: str,
    label: str = "",
    progress: bool = True,
) -> RunResult:
    """Run ``plans`` (from :func:`loadtest.scenario.make_plan`) against ``base_url``."""
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        models = await _get_json(session, base_url.rstrip("/") + "/v1/models")
        if not models or not models.get("data"):
            raise RuntimeError(f"{base_url}/v1/models did not answer: is the server up?")
        first = models["data"][0]
        model = scenario.model or first["id"]
        config = await _get_json(session, base_url.rstrip("/") + "/v1/obcache/config")
        obcache_defaults = (config or {}).get("defaults") if config else None

        before = await scrape.scrape(session, base_url)
        timeline = scrape.Timeline()
        stop = asyncio.Event()
        outcomes: list[Outcome] = []
        bar = _Progress(len(plans), label or scenario.name, progress)

        async def one(plan: RequestPlan) -> None:
            outcome = Outcome(plan)
            outcomes.append(outcome)
            try:
                await send(session, base_url, model, scenario.endpoint, outcome)
            finally:
                bar.done(outcome)

        start = time.perf_counter()
        started_at = datetime.now(UTC).isoformat(timespec="seconds")
        poller = asyncio.create_task(
            scrape.poll(
                session, base_url, timeline, start, before, scenario.scrape_interval_s, stop
            )
        )
        tasks: list[asyncio.Task] = []
        stopped_by = "count"
        try:
            async with asyncio.timeout(scenario.duration_s):
                await _issue(scenario, plans, one, tasks)
        except TimeoutError:
            stopped_by = "deadline"
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        duration = time.perf_counter() - start
        bar.close()

        idle, idle_wait = await _wait_idle(
            session, base_url, scenario.checks.idle_timeout_s, scenario.scrape_interval_s
        )
        await asyncio.sleep(max(1.0, scenario.scrape_interval_s))  # one more stats interval
        after = await scrape.scrape(session, base_url)
        stop.set()
        await poller
        healthy = await _healthy(session, base_url)

    outcomes.sort(key=lambda o: o.plan.index)
    return RunResult(
        scenario=scenario,
        label=label or scenario.name,
        base_url=base_url,
        model=model,
        max_model_len=first.get("max_model_len"),
        obcache_defaults=obcache_defaults,
        planned=len(plans),
        outcomes=outcomes,
        started_at=started_at,
        duration_s=duration,
        stopped_by=stopped_by,
        before=before,
        after=after,
        timeline=timeline,
        idle=idle,
        idle_wait_s=idle_wait,
        healthy=healthy,
    )
