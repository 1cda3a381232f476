"""The worker's request lifecycle without a model runner: plain scheduler messages in, a step
plan and a report out (what a Model Runner V2 binding would drive; the V1 binding is tested on
the real engine by every engine test)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from obcache_vllm.admission import parse_kv_options
from obcache_vllm.eviction.messages import EvictionOrder
from obcache_vllm.options import ADMITTED_KEY
from obcache_vllm.vllm_ext.worker.lifecycle import BatchRows, WorkerEviction

pytestmark = pytest.mark.unit

BS, LAYERS, PROMPT = 32, 2, 300


def _new(req_id: str, fields: dict | None):
    extra = None if fields is None else {
        ADMITTED_KEY: parse_kv_options(fields, PROMPT).to_wire()}  # fmt: skip
    return SimpleNamespace(req_id=req_id, prompt_token_ids=[1] * PROMPT,
                           sampling_params=SimpleNamespace(extra_args=extra))  # fmt: skip


def _output(new=(), finished=(), orders=None):
    return SimpleNamespace(
        finished_req_ids=set(finished), scheduled_new_reqs=list(new),
        scheduled_cached_reqs=SimpleNamespace(resumed_req_ids=set()),
        num_scheduled_tokens={}, kv_cache_block_copies=None, obcache_orders=orders or {},
    )  # fmt: skip


def _step(worker: WorkerEviction, output, rows: dict[str, tuple[int, int]], compacted: int):
    """One step: ``rows`` maps each request to (tokens computed before, tokens this step);
    every row's order is compacted in ``compacted`` layers."""
    worker.update_states(output, read_kv=None, num_layers=LAYERS)
    qsl = [0]
    for _, n in rows.values():
        qsl.append(qsl[-1] + n)
    batch = BatchRows(list(rows), qsl, [c for c, _ in rows.values()],
                      {r: PROMPT for r in rows})  # fmt: skip
    plan = worker.make_plan(output, batch, {f"layer{i}": i for i in range(LAYERS)}, "cpu")
    for row in plan.rows if plan else ():
        if row.order is not None:
            row.outcome.compacted_layers = compacted
    worker.commit(LAYERS)
    return plan, worker.take_report()


def test_an_order_applied_in_every_layer_is_reported_and_moves_the_state():
    worker = WorkerEviction(BS)
    order = EvictionOrder(logical_len=PROMPT, dead_before=0, dead_after=5, block_size=BS)
    plan, report = _step(worker, _output([_new("a", {"kv_budget": 64}), _new("s", None)],
                                         orders={"a": order}),
                         {"a": (0, PROMPT), "s": (0, 10)}, compacted=LAYERS)  # fmt: skip
    assert [r.req_id for r in plan.rows] == ["a"] and plan.dead == (0, 0)  # "s" is stock
    assert report.applied == ("a",) and not report.failures
    assert report.states["a"].dead == 5 and report.states["a"].tokens_evicted == 5 * BS
    # The next step reads past the dead blocks, and a finished request is forgotten.
    plan, _ = _step(worker, _output(), {"a": (PROMPT, 1)}, compacted=0)
    assert plan.dead == (5,)
    _step(worker, _output(finished=["a"]), {}, compacted=0)
    assert not worker.states


def test_a_stale_order_is_a_contained_desync_and_a_torn_one_is_fatal():
    worker = WorkerEviction(BS)
    stale = EvictionOrder(logical_len=PROMPT + 1, dead_before=0, dead_after=5, block_size=BS)
    _, report = _step(worker, _output([_new("a", {"kv_budget": 64})], orders={"a": stale}),
                      {"a": (0, PROMPT)}, compacted=0)  # fmt: skip
    (failure,) = report.failures
    assert (failure.req_id, failure.stage, failure.reason, failure.fatal) == (
        "a", "schedule", "desync", False)  # fmt: skip
    assert worker.states["a"].disabled and not report.applied
    order = EvictionOrder(logical_len=PROMPT, dead_before=0, dead_after=5, block_size=BS)
    _, report = _step(worker, _output([_new("b", {"kv_budget": 64})], orders={"b": order}),
                      {"b": (0, PROMPT)}, compacted=1)  # one layer of two: torn  # fmt: skip
    (failure,) = report.failures  # its cache is neither as before nor compacted: fatal
    assert (failure.req_id, failure.reason, failure.fatal) == ("b", "not_applied", True)


def test_an_order_for_a_request_the_worker_never_saw_is_reported_untracked():
    worker = WorkerEviction(BS)
    order = EvictionOrder(logical_len=PROMPT, dead_before=0, dead_after=5, block_size=BS)
    worker.update_states(_output([_new("a", {"kv_budget": 64})]), None, LAYERS)
    _, report = _step(worker, _output(orders={"ghost": order}), {"a": (0, PROMPT)}, compacted=0)
    assert [(f.req_id, f.reason) for f in report.failures] == [("ghost", "untracked")]


def test_a_recomputed_output_is_one_row_of_decode_queries_scored_at_once():
    """A preempted request recomputes its output: one row of several decode-time queries.
    With summed decode scores each of them counts (the row is scored in its step, after the
    queries stored before it; nothing of it goes to the one-query-per-step store, and it is
    never batched with single-query rows); with "last" only its newest query does."""
    worker = WorkerEviction(BS)
    h2o = {"kv_budget": 64, "kv_decode": True, "kv_pipeline": "h2o"}
    _step(worker, _output([_new("a", h2o), _new("b", h2o)]),
          {"a": (0, PROMPT), "b": (0, PROMPT)}, compacted=0)  # fmt: skip
    plan, _ = _step(worker, _output(), {"a": (PROMPT, 1), "b": (PROMPT, 1)}, compacted=0)
    assert [r.decode_position for r in plan.rows] == [0, 0]  # one stored query each
    assert worker.states["a"].decode_count == 1
    plan, _ = _step(worker, _output(), {"a": (PROMPT + 1, 5), "b": (PROMPT + 1, 1)},
                    compacted=0)  # fmt: skip
    a, b = plan.rows
    assert (a.decode_stored, a.decode_position, a.score_decode, a.active) == (1, None, True, True)
    assert (b.decode_stored, b.decode_position) == (None, 1)
    assert plan.decode_write[0].numel() == 1  # only b's query goes to the store
    assert not a.grouped
    assert worker.states["a"].decode_count == 0 and worker.states["b"].decode_count == 2
