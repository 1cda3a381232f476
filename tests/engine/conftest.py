"""Engine-test fixtures: one in-process plugin engine per session, a step driver, tokenizer.

See support/engine.py for why the engine runs in-process and how stock references are produced.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.engine import (
    ENGINE_KWARGS,
    POOL_BLOCKS,
    Driver,
    Internals,
    KvEventLog,
    close_stock,
    start_stock,
)

# Before any engine exists in this process (vLLM caches its env once an engine is up).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("OBCACHE_VLLM_RECORD_KEEP", "1")
# Requests may ask for a fault in eviction (test_faults.py; obcache_vllm/eviction/faults.py).
os.environ.setdefault("OBCACHE_VLLM_FAULTS", "1")
# The KV oracle (obcache_vllm/eviction/oracle.py) checks every reuse of KV in every engine test
# (see the autouse fixture `kv_oracle` below).
os.environ.setdefault("OBCACHE_VLLM_VERIFY", "1")
# VLLM_CPU_OMP_THREADS_BIND=0 (tests/conftest.py) binds the engines this session starts in
# other processes. The session engine below runs in this process, where vLLM ignores the
# variable (see obcache_vllm/cpu_binding.py): it keeps torch's thread per core, measured 1.57x
# faster than one thread here while it runs alone (results/ci/suite-time-2026-12-03.json); its stock
# reference runs only while it waits. In a lane (scripts/test_lanes.py: two sessions, a core
# each) OMP_NUM_THREADS=1 gives it one thread, and the other core runs the other lane.


@pytest.fixture(scope="session")
def engine_kwargs(model_path: Path) -> dict:
    return {"model": str(model_path), **ENGINE_KWARGS}


@pytest.fixture(scope="session")
def llm(engine_kwargs: dict) -> Iterator[object]:
    """The session's vLLM engine with the obcache plugin, EngineCore and worker in-process.

    It also carries the fidelity logits processor, which forces tokens (test_perplexity.py)
    and compares distributions (test_fidelity.py): requests without ``forced_tokens`` or
    ``fidelity`` never see it, so every other test still compares against stock vLLM.
    """
    from vllm import LLM
    from vllm.config import KVEventsConfig

    from loadtest.launch import free_port
    from obcache_vllm.evidence.fidelity import FIDELITY_FQCN

    start_stock(engine_kwargs)  # the stock reference loads on the other core meanwhile

    # KV events on, as a KV-aware router consumes them (test_prefix_cache.py reads them).
    events = KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=f"tcp://127.0.0.1:{free_port()}",
        topic="kv",
    )
    log = KvEventLog(events.endpoint, events.topic)
    engine = LLM(**engine_kwargs, logits_processors=[FIDELITY_FQCN], kv_events_config=events)
    engine.obcache_kv_events = log
    yield engine
    log.close()
    close_stock()
    core = getattr(getattr(engine, "llm_engine", None), "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()


@pytest.fixture(autouse=True)
def kv_oracle(request):
    """Every engine test that uses the shared engine also passes the KV oracle: no reuse of KV
    between requests (entries, adoptions, copies) read anything but what its donor left."""
    if "llm" not in request.fixturenames:
        yield
        return
    scheduler = Internals(request.getfixturevalue("llm")).scheduler
    seen = len(scheduler.obcache_mismatches)
    yield
    found = list(scheduler.obcache_mismatches)[seen:]
    assert not found, f"KV oracle mismatches: {found}"


@pytest.fixture(scope="session")
def kv_events(llm) -> KvEventLog:
    """The session engine's KV events, received over ZMQ since the engine started."""
    return llm.obcache_kv_events


@pytest.fixture(scope="session")
def engine(llm) -> Internals:
    internals = Internals(llm)
    assert type(internals.scheduler).__name__ == "OBCacheScheduler"
    assert type(internals.runner).__name__ == "OBCacheCPUModelRunner"
    return internals


@pytest.fixture(scope="session")
def tokenizer(model_path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_path))


@pytest.fixture
def driver(engine) -> Driver:
    assert not engine.llm.llm_engine.has_unfinished_requests()
    assert engine.free_blocks() == POOL_BLOCKS - 1  # block 0 is vLLM's null block
    return Driver(engine)


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """After the last engine test, the stock references go (they hold a KV pool each, and the
    server tests start servers of their own)."""
    if nextitem is None or Path(item.path).parent != Path(nextitem.path).parent:
        close_stock()
