"""The block ledger on plain values: what a budgeted request may read, copy, register, free."""

from __future__ import annotations

import pytest

from obcache_vllm.admission import parse_kv_options
from obcache_vllm.eviction.ledger import BlockLedger, CacheStart
from obcache_vllm.eviction.messages import RowState

BS = 32


def _open(prompt_len=1000, **kv):
    ledger = BlockLedger(BS)
    options = parse_kv_options({"kv_budget": 256, **kv}, prompt_len)
    return ledger, ledger.open("r", options, prompt_len)


def test_write_floor_bounds_every_order_of_the_request():
    _, blocks = _open(kv_decode=True, kv_pipeline="tova")
    floor = blocks.write_floor
    assert floor == (1000 - 256) // BS
    first = blocks.can_compact(1000, is_prefill_chunk=False)
    assert first is not None and first.dead_after == floor
    blocks.commit(RowState(first.dead_after, 1, first.tokens_evicted))
    for length in range(1001, 1400):  # every later decode-time order writes above the floor
        order = blocks.can_compact(length, is_prefill_chunk=False)
        if order is not None:
            assert order.dead_after >= floor
            blocks.commit(RowState(order.dead_after, blocks.evictions + 1, 0))


@pytest.mark.parametrize(
    "kv, limit",
    [
        pytest.param({"kv_pipeline": "snapkv", "kv_window": 64}, 936 // BS * BS, id="snapkv"),
        pytest.param({"kv_pipeline": "tova"}, 999 // BS * BS, id="tova"),
        pytest.param({"kv_pipeline": "streaming"}, 999 // BS * BS, id="streaming"),
        pytest.param({"kv_pipeline": "h2o"}, 0, id="h2o-needs-every-query"),
        pytest.param({"kv_pipeline": "tova", "kv_prefill_evict": True}, 0, id="prefill-evict"),
        pytest.param({"kv_pipeline": "tova", "kv_compress_at": 500}, 499 // BS * BS, id="at-k"),
    ],
)
def test_exact_hit_leaves_the_queries_the_pipeline_scores(kv, limit):
    _, blocks = _open(**kv)
    assert blocks.exact_hit(10_000) == limit
    assert blocks.exact_hit(100) == min(96, limit)  # block-aligned, never more than offered


def test_hit_blocks_at_or_above_the_floor_are_copied_before_compaction():
    _, blocks = _open(kv_pipeline="tova")
    floor = blocks.write_floor
    assert list(blocks.copy_on_write(floor + 3)) == [floor, floor + 1, floor + 2]
    assert list(blocks.copy_on_write(floor - 2)) == []  # all below: shared as they are


def test_registration_stops_at_the_floor_and_never_after_adopting_compressed_kv():
    _, blocks = _open(kv_pipeline="tova")
    assert blocks.registrable(900) == blocks.write_floor * BS
    assert blocks.registrable(100) == 100
    blocks.adopt(CacheStart("compress_at", 500, dead=3))
    assert blocks.registrable(900) == 0
    _, prefill_evict = _open(kv_pipeline="tova", kv_prefill_evict=True)
    assert prefill_evict.registrable(900) == 0


def test_commit_frees_what_the_worker_compacted_even_after_a_lost_report():
    ledger, blocks = _open(kv_pipeline="tova")
    order = blocks.can_compact(1000, is_prefill_chunk=False)
    assert blocks.past_point and blocks.cut_at() is None
    # The report of that step is lost; the next one carries the cumulative state.
    freed = ledger.commit("r", RowState(order.dead_after, 1, order.tokens_evicted, 256 + 8))
    assert freed == (0, order.dead_after)
    assert ledger.commit("r", RowState(order.dead_after, 1, order.tokens_evicted)) is None
    assert ledger.totals.blocks_freed == order.dead_after and ledger.totals.evictions == 1
    assert ledger.totals.by_option[("obcache_key", "tova")] == [
        order.tokens_evicted, order.dead_after, 1
    ]


def test_preemption_resets_and_release_records():
    ledger, blocks = _open(kv_pipeline="tova")
    order = blocks.can_compact(1000, is_prefill_chunk=False)
    ledger.commit("r", RowState(order.dead_after, 1, order.tokens_evicted))
    assert ledger.reset("r") and ledger.totals.compressed_preemptions == 1
    assert blocks.dead == 0 and not blocks.past_point and blocks.start is None
    assert not ledger.reset("r")  # nothing compressed since: not counted again
    record = ledger.release("r", 1003)
    assert record.resident_tokens == 1003 and "r" not in ledger
    assert ledger.finished[-1] is record


def test_no_order_before_the_compress_point_unless_prefill_evict():
    _, blocks = _open(kv_pipeline="tova", kv_compress_at=600)
    assert blocks.cut_at() == 600
    assert blocks.can_compact(512, is_prefill_chunk=True) is None
    assert blocks.can_compact(600, is_prefill_chunk=True) is not None
    _, bounded = _open(kv_pipeline="tova", kv_prefill_evict=True)
    assert bounded.can_compact(512, is_prefill_chunk=True) is not None
    assert not bounded.past_point  # the compress point (the prompt's end) is still ahead


def test_adopting_a_compressed_entry_inherits_its_dead_blocks():
    _, blocks = _open(kv_pipeline="tova", kv_compress_at=600)
    blocks.adopt(CacheStart("compress_at", 600, dead=10))
    assert blocks.dead == 10 and blocks.past_point and blocks.cut_at() is None
    assert blocks.can_compact(1000, is_prefill_chunk=False) is None  # no decode eviction asked


# -- found by the scheduler harness (tests/vllm/test_scheduler_sim.py) --------------------------
def test_no_order_writes_block_zero_so_the_floor_is_at_least_one():
    _, blocks = _open(prompt_len=300, kv_decode=True)  # budget 256: (300 - 256) // 32 == 1
    assert blocks.write_floor == 1
    _, over = _open(prompt_len=260, kv_decode=True)  # (260 - 256) // 32 == 0, yet every order
    assert over.write_floor == 1  # frees a block: block 0 is never written
    order = over.can_compact(300, is_prefill_chunk=False)
    assert order is not None and order.dead_after >= 1


def test_a_request_that_never_compacts_copies_nothing_and_registers_all():
    """A budget at or above the prompt without kv_decode or pressure: no order ever runs, so
    a prefix hit is shared as stock shares it (copies of it once made such a request too big
    for the pool: a stall) and everything it computes is stock KV."""
    _, blocks = _open(prompt_len=240)  # budget 256
    assert not blocks.may_compact
    assert list(blocks.copy_on_write(7)) == []
    assert blocks.can_compact(240, is_prefill_chunk=False) is None
    assert blocks.registrable(240 + 50) == 290
    _, at_k = _open(prompt_len=1000, kv_compress_at=200)  # 200 - 256 < 0: no order at k
    assert not at_k.may_compact
    assert at_k.registrable(990) == 200  # before its point: the chunk is cut there
    at_k.can_compact(200, is_prefill_chunk=True)  # the step that reaches the point
    assert at_k.past_point and at_k.registrable(990) == 990


def test_a_pressure_request_is_stock_until_compressed():
    _, blocks = _open(kv_pipeline="tova", kv_when="pressure")
    assert blocks.exact_hit(960) == 960  # the whole hit, as stock takes it
    assert list(blocks.copy_on_write(30)) == []  # nothing copied, as stock copies nothing
    assert blocks.registrable(1000) == 1000  # every block, as stock registers them
    order = blocks.compress_under_pressure(1000, "running")
    assert order is not None and order.pressure
    assert blocks.registrable(1000) == blocks.write_floor * BS  # compressed: kv_when always


def test_an_admission_under_pressure_that_fails_is_withdrawn():
    _, blocks = _open(kv_pipeline="tova", kv_when="pressure")
    blocks.admit_under_pressure()
    assert blocks.prefill_evicts and not blocks.on_pressure and not blocks.reads_cache
    blocks.withdraw_pressure_admission()
    assert blocks.on_pressure and blocks.pressure is None and blocks.reads_cache


def test_a_target_decodes_to_the_count_it_chose_or_what_was_resident_at_its_point():
    """``kv_decode`` with an error target: the prompt's order carries the target, decode-time
    orders do not and keep the count chosen at the point; where nothing was chosen (no whole
    block could go there), what was resident at the point, past an adopted entry's dead
    blocks (not the whole point)."""
    target = {"kv_budget": {"max_error": 0.05, "min": 80}, "kv_decode": True,
              "kv_pipeline": "tova"}  # fmt: skip
    _, blocks = _open(prompt_len=600, **target)
    first = blocks.can_compact(600, is_prefill_chunk=True)
    assert first is not None and first.max_error is not None
    blocks.commit(RowState(15, 1, 480, chosen=(120, 0.01)))  # chose 120 of 600
    assert blocks.decode_budget == 120
    later = next(o for n in range(601, 700) if (o := blocks.can_compact(n, False)) is not None)
    assert later.max_error is None and 120 <= later.kept < 120 + BS  # as a fixed budget of 120
    # An adopted session entry of 3 dead blocks, then nothing can go at the point (104
    # resident, the floor 80: less than a block over it).
    _, adopted = _open(prompt_len=200, **target)
    adopted.adopt(CacheStart("session", 150, dead=3))
    assert adopted.can_compact(200, is_prefill_chunk=True) is None
    assert adopted.decode_budget == 200 - 3 * BS
