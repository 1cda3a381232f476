"""Every feature together on the real scheduler, step by step, without a model.

The harness (tests/support/sched_sim) runs vLLM's scheduler, block pool and prefix cache with
obcache-vllm's seams, the front end's admission and the worker's eviction lifecycle over a
symbolic KV cache; after every step it checks safety, agreement and liveness (see its
``checks`` module). Here:

* random interleavings of every feature (hypothesis; derandomized, so CI runs the same
  cases every time; ``make sim`` runs millions of steps with fresh seeds);
* stock equivalence: without budgets the plugin's scheduler makes vLLM's own decisions, step
  by step, and ``kv_when: "pressure"`` requests are scheduled as stock until the first
  compression under pressure;
* the shrunk counterexamples the harness found, each a named regression;
* the harness itself, shown failing on deliberately broken builds.
"""

from __future__ import annotations

import logging

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.sched_sim.engine import SimConfig
from support.sched_sim.gen import RandomDraw, case_for, generate
from support.sched_sim.ops import Abort, Add, Case, Step, Stream, Turn, paired, run, tokens
from support.sched_sim.shrink import findings, kind_of, pasteable, shrink_finding

pytestmark = pytest.mark.vllm

SWEEP = 1500  # seeded cases of scripts/sim.py's mix, every run (make sim runs millions of steps)


def _examples(n: int):
    return settings(max_examples=n, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))  # fmt: skip


class HypothesisDraw:
    def __init__(self, data) -> None:
        self.data = data

    def int(self, lo: int, hi: int) -> int:
        return self.data.draw(st.integers(lo, hi))

    def pick(self, options):
        return self.data.draw(st.sampled_from(tuple(options)))


@pytest.fixture(autouse=True)
def _quiet(caplog):
    # Contained faults are logged as warnings; here each one is a violation already.
    logging.getLogger("obcache_vllm").setLevel(logging.ERROR)
    yield
    logging.getLogger("obcache_vllm").setLevel(logging.NOTSET)


def _explain(case: Case, sim) -> str:
    found = "\n".join(str(v) for v in sim.violations[:8])
    return f"{found}\n\ncase = {pasteable(case)}"


def assert_clean(case: Case):
    sim = run(case)
    assert not sim.violations, _explain(case, sim)
    return sim


# -- every feature, interleaved ---------------------------------------------------------------
def test_seeded_sweep_of_every_feature_and_both_equivalences():
    """scripts/sim.py's mix, seeds 0..SWEEP-1: three in five with every feature, one in five
    without budgets against vLLM's own scheduler, one in five with ``kv_when: "pressure"``
    budgets against the same traffic unbudgeted. A failure is shrunk and printed as a
    ``Case(...)`` to paste below as a named regression."""
    for seed in range(SWEEP):
        case, mode = case_for(seed)
        found = findings(case, mode)
        if found:
            small = shrink_finding(case, mode, kind_of(found[0]), budget=150)
            pytest.fail(f"seed {seed} ({mode}): {found[0]}\n\nshrunk: {pasteable(small)}")


@_examples(300)
@given(st.data())
def test_every_feature_together(data):
    """The same mix drawn by hypothesis, which shrinks what it finds by itself."""
    assert_clean(generate(HypothesisDraw(data)))


@_examples(100)
@given(st.data())
def test_stock_traffic_is_scheduled_as_stock(data):
    """No budget anywhere: obcache-vllm's scheduler makes vLLM's own ``Scheduler``'s
    decisions (admissions, chunks, preemptions, block tables, copies) at every step, and
    every request gets the same tokens."""
    case = generate(HypothesisDraw(data), stock_only=True)
    found = findings(case, "stock")
    assert not found, f"{found[:3]}\n{pasteable(case)}"


@_examples(100)
@given(st.data())
def test_pressure_requests_run_as_stock_until_pressure(data):
    """``kv_when: "pressure"`` requests are scheduled exactly as the same requests without a
    budget on vLLM's own scheduler, up to the step of the first compression (or admission)
    under pressure."""
    case = generate(HypothesisDraw(data), only_pressure=True)
    found = findings(case, "pressure")
    assert not found, f"{found[:3]}\n{pasteable(case)}"


# -- the counterexamples it found, shrunk (each failed before its fix) ------------------------
def kinds_of(case: Case) -> set[str]:
    return {v.kind for v in run(case).violations}


SESSION = (("kv_budget", 56), ("kv_session", True))


def test_prefill_evict_request_reclaims_held_entries_instead_of_stalling():
    """Two session entries hold 18 of 39 blocks; a ``kv_prefill_evict`` request whose peak
    (23 blocks) fits the pool but not the 21 free ones was refused before the holds could be
    released, every step, with a stock request queued behind it (the engine stalled)."""
    config = SimConfig(num_blocks=40, share=0.5, share_max=0.5, max_batched_tokens=48)
    assert_clean(Case(config, (
        Add(1, 0, 0, 90, 8, SESSION), Add(2, 1, 0, 90, 8, SESSION), Step(12),
        Add(3, 2, 0, 150, 180, (("kv_budget", 24), ("kv_prefill_evict", True))),
        Add(4, 2, 0, 5, 4), Step(3),
    )))  # fmt: skip


PRESSURE = (("kv_budget", 24), ("kv_when", "pressure"), ("kv_window", 8))


def test_pressure_admission_never_copies_blocks_written_in_the_same_step():
    """r1 registers three blocks of a shared prefix in a step; r2 (``kv_when: pressure``)
    hits them in the same ``schedule()``, does not fit as stock and is admitted compressed:
    its copy-on-write then read those blocks before the forward pass had written them
    (stale KV, and the project's own KV oracle saw ``copy_in_flight``)."""
    config = SimConfig(num_blocks=24, max_batched_tokens=32, share=0.0, share_max=0.0)
    assert_clean(Case(config, (
        Add(0, 1, 0, 64, 40), Step(4),
        Add(1, 0, 24, 2, 1), Add(2, 0, 24, 100, 4, PRESSURE), Step(6),
    )))  # fmt: skip


def test_pressure_admission_is_undone_when_it_fails():
    """A request switched to admission-under-pressure stayed switched when that allocation
    failed too; later, with room for it as stock, it wanted copies of its whole prefix hit
    and was never admitted (a stall with the whole pool free)."""
    config = SimConfig(num_blocks=24, max_batched_tokens=32, share=0.5, share_max=0.5)
    assert_clean(Case(config, (
        Add(3, 2, 64, 78, 7, (), "s1"), Step(25),
        Add(6, 2, 240, 19, 12, (("kv_budget", 43), ("kv_pipeline", "adakv"))),
        Turn(7, 3, 6, 13, (("kv_budget", 111), ("kv_when", "pressure"), ("kv_window", 8)), "s1"),
        Step(10),
    )))  # fmt: skip


def test_budget_over_the_prompt_with_a_prefix_hit_is_admitted():
    """A budget above the prompt never compacts (no ``kv_decode``), yet its whole prefix hit
    was queued for copy-on-write: the hit plus the copies never fitted a 23-block pool."""
    config = SimConfig(num_blocks=24, max_batched_tokens=32, share=0.5, share_max=0.5)
    assert_clean(Case(config, (
        Add(3, 2, 64, 39, 1), Step(4),
        Turn(7, 3, 1, 1, (("kv_budget", 111), ("kv_window", 8))), Step(3),
    )))  # fmt: skip


def test_prefix_hit_copies_never_outgrow_the_pool():
    """A prefix hit whose blocks above the write floor must be copied: the prompt's blocks
    plus those copies exceed the pool, so the request could never be admitted."""
    config = SimConfig(num_blocks=24, max_batched_tokens=32, share=0.5, share_max=0.5)
    assert_clean(Case(config, (
        Add(1, 2, 160, 0, 1), Step(6),
        Add(2, 2, 160, 8, 1, (("kv_budget", 100), ("kv_window", 8))), Step(3),
    )))  # fmt: skip


def test_an_entry_whose_copies_outgrow_the_pool_is_not_adopted():
    """A chat's next turn (``"auto"``: a session) adopted its 30-block entry and had to copy
    the 15 blocks its own compression would rewrite: 46 blocks for a 39-block pool, so it was
    never admitted. Now it computes its prompt itself (31 blocks) when the copies do not fit."""
    auto = (("kv_budget", 0.5), ("kv_compress_at", "auto"), ("kv_recent", 4), ("kv_window", 16))
    config = SimConfig(num_blocks=40, max_num_seqs=2, max_batched_tokens=48, share=0.25,
                       share_max=0.75)  # fmt: skip
    assert_clean(Case(config, (Add(3, 0, 96, 3, 142, auto), Turn(4, 3, 1, 1, auto), Step(3))))


def test_an_entrys_partial_last_block_counts_among_its_copies():
    """Found by the long run: a chat's next turn adopted a 97-token session entry whose
    copies (10 blocks it rewrites) fitted beside its prompt (13 blocks) in the 23-block pool,
    but vLLM also copies the entry's partial last block: 24 blocks, never admitted."""
    auto = (("kv_budget", 80), ("kv_compress_at", "auto"), ("kv_pipeline", "streaming"),
            ("kv_recent", 4), ("kv_scorer", "attn"), ("kv_window", 16))  # fmt: skip
    config = SimConfig(num_blocks=24, max_batched_tokens=48, share=0.0, share_max=0.0)
    assert_clean(Case(config, (Add(1, 2, 64, 17, 17, auto), Turn(3, 1, 1, 1, auto), Step(3))))


def test_budgeted_streaming_input_is_refused():
    """vLLM's streaming inputs keep a request and its blocks between chunks and schedule the
    next chunk as a new request under the same id: the worker started it afresh (no dead
    blocks) and attention read the null blocks as KV. Budgets are refused for resumable
    requests; unbudgeted streams go on as stock."""
    config = SimConfig(num_blocks=24, max_batched_tokens=96, share=0.0, share_max=0.0)
    case = Case(config, (
        Add(5, 1, 0, 78, 1, (("kv_budget", 35),), stream=True), Stream(5, 4), Step(2),
        Add(6, 1, 0, 78, 2, (), stream=True), Step(2), Stream(6, 4), Step(3), Stream(6, 0),
        Step(3),
    ))  # fmt: skip
    sim = assert_clean(case)
    assert "streaming" in sim.results["r5"].refused
    assert sim.results["r6"].finish is not None and not sim.results["r6"].refused


def test_session_id_never_gives_an_error_target_a_session():
    """A vLLM ``session_id`` joined an error-target request to a session (an explicit
    ``kv_session`` is refused): each turn would estimate its error on an already compressed
    cache."""
    target = (("kv_budget", {"max_error": 0.01}),)
    assert_clean(Case(SimConfig(), (Add(1, 0, 96, 10, 4, target, "s1"), Step(10))))


def test_auto_compress_point_only_for_pipelines_that_leave_entries():
    """``kv_compress_at: "auto"`` chose a query-agnostic compress point for adakv and h2o,
    whose caches never become entries: a cost for nothing."""
    for pipeline in ("adakv", "h2o"):
        fields = (("kv_budget", 36), ("kv_compress_at", "auto"), ("kv_pipeline", pipeline))
        assert_clean(Case(SimConfig(), (Add(1, 0, 64, 1, 1, fields), Add(3, 0, 64, 1, 1, fields),
                                        Step(8))))  # fmt: skip


def test_lookup_without_admission_leaves_nothing_behind():
    """A continuation looked up its session entry, could not be admitted (the pool was busy)
    and was aborted: the lookup had already made the tentative entry an ordinary one, and
    the aborted request reported -24 resident tokens (its entry's dead blocks)."""
    auto = (("kv_budget", 40), ("kv_compress_at", "auto"))
    config = SimConfig(num_blocks=30, max_batched_tokens=48, share=0.25, share_max=0.5)
    assert_clean(Case(config, (
        Add(1, 0, 0, 70, 6, auto), Step(6), Add(3, 1, 0, 150, 60), Step(6),
        Turn(2, 1, 10, 4, auto), Step(2), Abort(2), Step(2),
    )))  # fmt: skip


def test_entry_copy_never_takes_room_a_running_request_needs():
    """A ``kv_compress_at`` entry's copy took 11 free blocks between two steps; in the next
    one a running request could not grow and was preempted (the entry's docstring: no entry
    rather than taking a live request's room)."""
    config = SimConfig(num_blocks=40, max_num_seqs=2, max_batched_tokens=96)
    assert_clean(Case(config, (
        Add(2, 1, 96, 49, 3, (("kv_budget", 118),)),
        Add(3, 0, 96, 49, 1, (("kv_budget", 82), ("kv_compress_at", -14))), Step(4),
    )))  # fmt: skip


def test_a_new_documents_entry_takes_the_room_of_entries_no_one_reads():
    """Four documents' ``kv_compress_at`` entries, never read, fill the room the pool has
    spare (three in four of its blocks may be held); a fifth document's copy finds too few
    free blocks. Its entry takes the room of the held entries that rank before a new one
    (overdue, never read) instead of being dropped, so the question that follows over the
    fifth document adopts it (before: the copy was skipped and every later question over a
    new document compressed it again while the old entries stayed held)."""
    fields = (("kv_budget", 40), ("kv_compress_at", 96), ("kv_pipeline", "tova"))
    ops = []
    for doc in range(4):
        ops += [Add(doc + 1, doc, 150, 0, 4, fields), Step(30)]
    ops += [Add(5, 4, 150, 0, 4, fields), Step(30), Add(6, 4, 150, 3, 4, fields), Step(30)]
    config = SimConfig(num_blocks=40, max_batched_tokens=48, share=0.25, share_max=0.75)
    sim = assert_clean(Case(config, tuple(ops)))
    counts = sim.scheduler.obcache_prefix.counts
    assert counts[("compress_at", "created")] == 5 and counts[("compress_at", "released")] >= 1
    assert sim.results["r6"].outcome.get("reused_from") == "compress_at"
    assert sim.results["r6"].outcome["reused_tokens"] == 96


# -- the harness itself: each check fails on a deliberately broken build ----------------------
def _first_seed_showing(kind: str, cases: int = 400, **kwargs) -> int | None:
    for seed in range(cases):
        if kind in kinds_of(generate(RandomDraw(seed), **kwargs)):
            return seed
    return None


def _no_copies(self, num_hit_blocks):
    return range(0)


def _register_everything(self, num_tokens):
    return num_tokens


def _free_one_more(self, req_id, first, last):
    self.group._remove_blocks_in_range(req_id, first, last + 1)


def _forget_starts(original):
    def update_states(self, scheduler_output, read_kv, num_layers):
        from obcache_vllm.vllm_ext.wire import STARTS_ATTR

        if getattr(scheduler_output, STARTS_ATTR, None):
            setattr(scheduler_output, STARTS_ATTR, {})
        return original(self, scheduler_output, read_kv, num_layers)

    return update_states


def _no_check(self, req_id, order):
    return None


@pytest.mark.parametrize(
    "broken, kind",
    [
        # obcache's own guard (check_writable) contains it: a counted fault
        pytest.param({"ledger.RequestBlocks.copy_on_write": _no_copies}, "fault",
                     id="no-copy-on-write"),  # fmt: skip
        # ...and without the guard, requests read KV another one overwrote
        pytest.param({"ledger.RequestBlocks.copy_on_write": _no_copies,
                      "blocks.PoolAdapter.check_writable": _no_check}, "stale_read",
                     id="no-copy-on-write-no-guard"),  # fmt: skip
        pytest.param({"ledger.RequestBlocks.registrable": _register_everything}, "registered",
                     id="registers-compacted-blocks"),  # fmt: skip
        pytest.param({"blocks.PoolAdapter.free_head": _free_one_more}, "table",
                     id="frees-a-live-block"),  # fmt: skip
    ],
)
def test_the_harness_sees_a_broken_build(monkeypatch, broken, kind):
    from obcache_vllm.eviction import ledger
    from obcache_vllm.vllm_ext.engine import blocks

    modules = {"ledger": ledger, "blocks": blocks}
    for target, replacement in broken.items():
        module, cls, name = target.split(".")
        monkeypatch.setattr(getattr(modules[module], cls), name, replacement)
    assert _first_seed_showing(kind) is not None, f"no case showed {kind} with {broken}"


def test_the_harness_sees_a_worker_that_forgets_adopted_dead_blocks(monkeypatch):
    from obcache_vllm.vllm_ext.worker.lifecycle import WorkerEviction

    monkeypatch.setattr(WorkerEviction, "update_states",
                        _forget_starts(WorkerEviction.update_states))  # fmt: skip
    assert _first_seed_showing("dead_disagree") is not None


def test_the_harness_sees_a_stall_and_a_stock_difference(monkeypatch):
    """Held entries never given up: the prefill-evict case stalls again; the plugin's
    allocation made to reserve one block more than vLLM's: stock traffic diverges."""
    from obcache_vllm.vllm_ext.engine.prefix import PrefixAdapter

    config = SimConfig(num_blocks=40, share=0.5, share_max=0.5, max_batched_tokens=48)
    case = Case(config, (
        Add(1, 0, 0, 90, 8, SESSION), Add(2, 1, 0, 90, 8, SESSION), Step(12),
        Add(3, 2, 0, 150, 180, (("kv_budget", 24), ("kv_prefill_evict", True))),
        Add(4, 2, 0, 5, 4), Step(3),
    ))  # fmt: skip
    with monkeypatch.context() as patch:
        patch.setattr(PrefixAdapter, "reclaim", lambda self, request: False)
        assert "stall" in kinds_of(case)
    from obcache_vllm.vllm_ext.engine.blocks import PoolAdapter

    original = PoolAdapter._allocate

    def greedy(self, request, num_new_tokens, blocks, args, kwargs):
        kwargs = {**kwargs, "reserved_blocks": kwargs.get("reserved_blocks", 0) + 1}
        return original(self, request, num_new_tokens, blocks, args, kwargs)

    monkeypatch.setattr(PoolAdapter, "_allocate", greedy)
    differs = 0
    for seed in range(60):
        ours, stock = paired(generate(RandomDraw(seed), stock_only=True), end=False)
        differs += ours.trace != stock.trace[: len(ours.trace)] or tokens(ours) != tokens(stock)
    assert differs


def test_a_repeated_prompt_is_served_from_its_first_sightings_cache_exactly():
    """Re-sent contexts: the first sighting of a prompt under ``"auto"`` compresses all but its
    last token (a tentative session), and leaves that compressed prefix as a ``kv_compress_at``
    entry on the session entry's own blocks; the same prompt sent again compresses at the same
    point, adopts it (the harness checks the entry against a recompute of the prefix) and
    samples the same tokens."""
    auto = (("kv_budget", 0.25), ("kv_compress_at", "auto"))
    config = SimConfig(num_blocks=40, max_batched_tokens=48, share=0.25, share_max=0.75)
    ops = (Add(1, 0, 150, 0, 6, auto), Step(20), Add(2, 0, 150, 0, 6, auto), Step(20),
           Add(3, 0, 150, 0, 6, auto), Step(20))  # fmt: skip
    sim = assert_clean(Case(config, ops))
    first, *again = (sim.results[r] for r in ("r1", "r2", "r3"))
    assert first.outcome.get("compress_at") == 149 and "reused_from" not in first.outcome
    for r in again:
        assert r.outcome.get("reused_from") == "compress_at", r.outcome
        assert r.outcome.get("compress_at") == 149 and r.tokens == first.tokens
    counts = sim.scheduler.obcache_prefix.counts
    assert counts[("compress_at", "hit")] == 2 and counts[("compress_at", "created")] == 1


def test_a_target_at_a_compress_point_and_a_fixed_budget_of_its_floor_keep_apart():
    """An error target at ``kv_compress_at`` leaves its compressed document as an entry that a
    later request with the same target adopts (its choice reported again); a fixed budget
    equal to the target's floor, at the same point with the same options, neither adopts it
    nor leaves an entry the target adopts: the entry key holds ``max_error``."""
    common = (("kv_compress_at", 96), ("kv_pipeline", "tova"), ("kv_scorer", "attn"))
    target = (("kv_budget", {"max_error": 0.2, "min": 40}), *common)
    fixed = (("kv_budget", 40), *common)
    config = SimConfig(num_blocks=40, max_batched_tokens=48, share=0.25, share_max=0.75)
    ops = (Add(1, 0, 150, 0, 6, target), Step(20), Add(2, 0, 150, 1, 6, fixed), Step(20),
           Add(3, 0, 150, 2, 6, target), Step(20), Add(4, 0, 150, 3, 6, fixed), Step(20))
    sim = assert_clean(Case(config, ops))
    r1, r2, r3, r4 = (sim.results[f"r{i}"].outcome for i in range(1, 5))
    assert "chosen_budget" in r1 and "reused_from" not in r1, r1
    assert "reused_from" not in r2, r2  # not the target's cache
    assert r3.get("reused_from") == "compress_at", r3
    assert (r3["chosen_budget"], r3["estimated_error"]) == (r1["chosen_budget"],
                                                            r1["estimated_error"])
    assert r4.get("reused_from") == "compress_at" and "chosen_budget" not in r4, r4


def test_a_target_decodes_to_the_count_it_chose(monkeypatch):
    """An error target with ``kv_decode``: every decode-time order keeps the count chosen at
    the prompt's end (the harness's ``target_decode`` check), and the order carries no target
    of its own; a ledger that orders decode down to the target's floor is seen."""
    from obcache_vllm.eviction.ledger import RequestBlocks

    fields = (("kv_budget", {"max_error": 0.01, "min": 40}), ("kv_decode", True),
              ("kv_pipeline", "tova"))  # fmt: skip
    config = SimConfig(num_blocks=64, block_size=8, max_num_seqs=2, max_batched_tokens=96,
                       max_model_len=512)  # fmt: skip
    case = Case(config, (Add(1, 0, 150, 0, 60, fields), Step(120)))
    sim = assert_clean(case)
    outcome = sim.results["r1"].outcome
    assert outcome["chosen_budget"] > 40 and outcome["evictions"] >= 3, outcome
    monkeypatch.setattr(RequestBlocks, "decode_budget",
                        property(lambda self: self.options.budget))  # the floor
    assert "target_decode" in {v.kind for v in run(case).violations}
