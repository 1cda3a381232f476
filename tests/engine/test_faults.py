"""Fault injection on the real engine: a fault in eviction degrades one request, never the engine.

The session engine runs with ``OBCACHE_VLLM_FAULTS=1`` (tests/engine/conftest.py), so a request
can ask for a fault with ``extra_args={"obcache_fault": ...}`` (obcache_vllm/eviction/faults.py).
Each case runs a mixed batch of five: two unbudgeted requests (oracle: stock vLLM, plugin
disabled, same batch), two budgeted ones (oracle: the same batch on the plugin engine without the
fault) and the faulty one. Then: the engine is still serving, the neighbours' tokens are exactly
their oracle's, the failure counter moved by one for the right (stage, reason), a warning names
the request, and every block is back in the pool.
"""

from __future__ import annotations

import logging
import re

import pytest
from support.engine import POOL_BLOCKS, run_stock
from support.texts import needle_prompt

MAX_TOKENS = 16
NAMES = ("plain0", "budget0", "faulty", "plain1", "budget1")
KV = {
    "budget0": {"kv_budget": 0.3, "kv_pipeline": "snapkv", "kv_scorer": "obcache_key"},
    "faulty": {"kv_budget": 0.25, "kv_pipeline": "tova", "kv_scorer": "obcache_joint"},
    "budget1": {"kv_budget": 96, "kv_pipeline": "h2o", "kv_scorer": "attn", "kv_decode": True},
}


@pytest.fixture(scope="module")
def prompts(tokenizer) -> dict[str, list[int]]:
    out = {name: tokenizer(needle_prompt(9 + i, seed=30 + i)[0]).input_ids
           for i, name in enumerate(NAMES)}  # fmt: skip
    # All five fit the 96-block pool at once with their outputs: no preemption muddles oracles.
    assert sum(-(-(len(p) + MAX_TOKENS) // 32) for p in out.values()) < POOL_BLOCKS - 8
    assert all(len(p) > 256 for p in out.values())  # chunked prefill (256 per step)
    return out


def _params(fault: str | None):
    from vllm import SamplingParams

    params = []
    for name in NAMES:
        extra = dict(KV.get(name, {}))
        if name == "faulty" and fault is not None:
            extra["obcache_fault"] = fault
        params.append(
            SamplingParams(temperature=0, max_tokens=MAX_TOKENS, extra_args=extra or None)
        )
    return params


def _generate(engine, prompts, fault: str | None):
    # Every run of the batch starts cold: cached prefixes would let several budgeted requests
    # reach their compress point in the same step (one lost report, several orders).
    assert engine.llm.reset_prefix_cache()
    outs = engine.llm.generate(
        [{"prompt_token_ids": prompts[n]} for n in NAMES], _params(fault), use_tqdm=False
    )
    return {n: o for n, o in zip(NAMES, outs, strict=True)}


@pytest.fixture(scope="module")
def stock(engine, engine_kwargs, prompts) -> dict[str, list[int]]:
    assert engine
    batch = [{"prompt_token_ids": prompts[n], "max_tokens": MAX_TOKENS} for n in NAMES]
    return dict(zip(NAMES, run_stock(engine_kwargs, [batch])[0], strict=True))


@pytest.fixture(scope="module")
def fault_free(engine, prompts) -> dict[str, list[int]]:
    before = engine.scheduler.obcache_totals.evictions
    outs = _generate(engine, prompts, None)
    assert engine.scheduler.obcache_totals.evictions > before
    return {n: list(o.outputs[0].token_ids) for n, o in outs.items()}


def _is_engine_id(engine_id: str, request_id: str) -> bool:
    """Whether ``engine_id`` is the engine's id of the ``LLM.generate`` request ``request_id``
    (vLLM's input processor appends ``-`` and 8 random hex digits)."""
    return re.fullmatch(re.escape(request_id) + r"-[0-9a-f]{8}", engine_id) is not None


# fault -> (failure counter key, the faulty request's fate)
CASES = [
    pytest.param("schedule", ("schedule", "injected"), "uncompressed", id="schedule-raises"),
    pytest.param("desync", ("schedule", "desync"), "uncompressed", id="worker-refuses-bad-order"),
    pytest.param("score", ("score", "injected"), "uncompressed", id="scoring-raises"),
    pytest.param("compact:5", ("compact", "injected"), "error", id="compaction-torn-at-layer-5"),
    pytest.param("report", ("report", "missing"), "compressed", id="worker-report-lost"),
]


@pytest.mark.parametrize(("fault", "counter", "fate"), CASES)
def test_a_fault_in_eviction_degrades_only_its_request(
    engine, prompts, stock, fault_free, caplog, fault, counter, fate
):
    totals = engine.scheduler.obcache_totals
    failures_before = dict(totals.failures)
    with caplog.at_level(logging.WARNING, logger="obcache_vllm"):
        outs = _generate(engine, prompts, fault)
    got = {n: list(o.outputs[0].token_ids) for n, o in outs.items()}

    for name in ("plain0", "plain1"):
        assert got[name] == stock[name], f"unbudgeted neighbour {name} changed"
    for name in ("budget0", "budget1"):
        assert got[name] == fault_free[name], f"budgeted neighbour {name} changed"
        assert outs[name].outputs[0].finish_reason == "length"

    faulty = outs["faulty"].outputs[0]
    if fate == "uncompressed":  # nothing was changed: it is a stock request from then on
        assert got["faulty"] == stock["faulty"]
        assert faulty.finish_reason == "length"
    elif fate == "compressed":  # the eviction did happen; only its report was lost
        assert got["faulty"] == fault_free["faulty"]
    else:
        assert faulty.finish_reason == "error"
        assert len(got["faulty"]) < MAX_TOKENS

    assert totals.failures.get(counter, 0) == failures_before.get(counter, 0) + 1
    assert sum(totals.failures.values()) == sum(failures_before.values()) + 1
    named = re.compile(r"request (\S+) \(stage=")
    logged = [m.group(1) for r in caplog.records if (m := named.search(r.getMessage()))]
    assert any(_is_engine_id(i, outs["faulty"].request_id) for i in logged), logged
    assert not engine.llm.llm_engine.has_unfinished_requests()
    assert engine.free_blocks() == POOL_BLOCKS - 1


def test_lost_report_is_made_good_by_the_next_one(engine, prompts, fault_free):
    """The scheduler frees the compacted-away blocks one step late, and accounts them."""
    outs = _generate(engine, prompts, "report")
    rid = outs["faulty"].request_id
    finished = reversed(engine.scheduler.obcache_finished)
    record = next(r for r in finished if _is_engine_id(r.req_id, rid))
    n = len(prompts["faulty"])
    budget = -(-n // 4)  # kv_budget 0.25, rounded up
    assert record.evictions == 1
    assert record.blocks_freed == (n - budget) // 32
    assert record.tokens_evicted == record.blocks_freed * 32
    assert engine.free_blocks() == POOL_BLOCKS - 1
