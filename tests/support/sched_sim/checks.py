"""The invariants checked after every simulated step, and at the end of a sequence.

Safety
  * ``stale_read``, ``write_null``, ``no_block``, ``dead_disagree``, ``cache_length``,
    ``adopt_*``, ``order_mismatch``, ``start_dead`` (worker.py): every slot a request attends
    to holds what its own cache must hold;
  * ``refcount``: every block's reference count equals its holders (requests' block tables,
    held entries, queued copies), and the free queue holds exactly the unreferenced blocks;
  * ``registered``: a block registered under a token hash holds exactly the stock KV of
    those tokens (a compacted block must never be a prefix-cache hit);
  * ``table``: the scheduler's and the worker's block tables of every scheduled request
    agree (beyond the dead head blocks, which are null on the scheduler's side);
  * ``ledger``: the scheduler's dead count of a budgeted request equals the worker's;
  * ``fault`` / ``oracle``: obcache-vllm counted no contained fault and its KV oracle no
    mismatch (the harness injects none: each one is a defect it found);
  * ``options`` (:func:`check_admitted`): what admission let through obeys the rules the
    docs state (an error target never evicts at decode steps, prefill chunks or under
    pressure; ``"auto"``
    chooses a compress point only for pipelines that leave and adopt entries);
  * ``adopt_target``: a fixed budget adopts only a fixed budget's compressed context, an
    error target only a target's (the entry key holds ``max_error``);
  * ``outcome``: no finished request reports a negative resident count;
  * ``tentative``: a tentative session entry becomes an ordinary one only when a request
    that adopts it (or the compressed prefix exposed on its blocks) is admitted;
  * ``copy_preempts``: a step that preempts a running request starts with no entry copy
    queued (an entry is made from room the running requests do not need next).

Liveness
  * ``stall``: two steps in a row scheduled nothing while nothing ran, a request waited, and
    releasing every held entry would have emptied the pool (so the head of the queue fits,
    and must be admitted within one step: admission
    refuses what can never fit; a streaming session that grew past the pool is the one
    exception, in stock vLLM as well);
  * at the end (:func:`check_end`): every request finishes once the operations stop
    (``undrained``), and then no block is left in use (``leak``, ``reset``).
"""

from __future__ import annotations

from collections import Counter

from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id
from vllm.v1.request import RequestStatus

from obcache_vllm.eviction.entries import is_tag

from .kv import StockChain


def _manager(sim):
    return sim.scheduler.kv_cache_manager.coordinator.single_type_managers[0]


ENTRY_PIPELINES = ("snapkv", "tova", "streaming")  # pipelines whose caches become entries


def check_admitted(sim, req_id: str, fields: dict, options) -> None:
    """The admitted ``options`` of a request sent with ``fields``."""
    if options is None:
        return
    if options.max_error is not None:
        bad = [name for name, on in (("prefill_evict", options.prefill_evict),
                                     ("pressure", options.when != "always")) if on]  # fmt: skip
        if bad:
            sim.worker.violate("options", f"{req_id}: an error target admitted with {bad}")
    if (
        fields.get("kv_compress_at") == "auto"
        and options.compress_at is not None
        and options.pipeline not in ENTRY_PIPELINES
    ):
        sim.worker.violate("options", f"{req_id}: \"auto\" compresses {options.pipeline} at "
                           f"{options.compress_at}, but it leaves no entry")  # fmt: skip


def before_step(sim) -> None:
    """What :func:`check_step` compares with (taken before ``schedule()``)."""
    if sim.cfg.plugin:
        prefix = sim.scheduler.obcache_prefix
        sim._queued_copies = len(prefix._copying)
        sim._tentative = set(prefix.held._tentative)


def check_step(sim, out) -> None:
    """Every per-step invariant of the module docstring, after ``out`` ran."""
    _faults(sim)
    _entries(sim, out)
    _outcomes(sim)
    _refcounts(sim)
    _registered(sim)
    _tables(sim, out)
    _liveness(sim, out)


def _faults(sim) -> None:
    scheduler = sim.scheduler
    if not sim.cfg.plugin:
        return
    seen = getattr(sim, "_faults_seen", 0)
    failures = scheduler.obcache_totals.failures
    total = sum(failures.values())
    if total > seen:
        sim.worker.violate("fault", f"obcache counted contained faults: {dict(failures)}")
    sim._faults_seen = total
    seen = getattr(sim, "_mismatches_seen", 0)
    mismatches = list(scheduler.obcache_mismatches)
    if len(mismatches) > seen:
        sim.worker.violate("oracle", f"KV oracle: {mismatches[seen:]}")
    sim._mismatches_seen = len(mismatches)


def _entries(sim, out) -> None:
    if not sim.cfg.plugin:
        return
    if out.preempted_req_ids and getattr(sim, "_queued_copies", 0):
        sim.worker.violate("copy_preempts", f"{sorted(out.preempted_req_ids)} preempted while "
                           f"{sim._queued_copies} blocks were taken by entry copies")  # fmt: skip
    held = sim.scheduler.obcache_prefix.held
    now = set(held._tentative)
    adopted = set()
    ledger = sim.scheduler.obcache_ledger
    admitted = [n.req_id for n in out.scheduled_new_reqs]
    admitted += list(out.scheduled_cached_reqs.resumed_req_ids)
    for req_id in admitted:
        record = ledger.get(req_id)
        if record is not None and record.start is not None and record.start.entry_id:
            adopted.add(record.start.entry_id)
            # a fixed budget adopts a fixed budget's cache, an error target a target's (whose
            # entry carries its choice): the entry key holds max_error
            target = record.options.max_error is not None
            if record.start.kind == "compress_at" and target != (record.start.chosen is not None):
                sim.worker.violate("adopt_target", f"{req_id} (max_error "
                                   f"{record.options.max_error}) adopted entry "
                                   f"{record.start.entry_id} (chosen {record.start.chosen})")
            # an entry on another's blocks (a first sighting's compressed prefix) is a read
            # of the entry that holds them
            adopted.add(sim.scheduler.obcache_prefix._holder.get(record.start.entry_id))
    for entry_id in getattr(sim, "_tentative", set()) - now:
        if entry_id in held and entry_id not in adopted:
            sim.worker.violate("tentative", f"entry {entry_id} stopped being tentative with "
                               "no admitted request adopting it")  # fmt: skip


def _outcomes(sim) -> None:
    if not sim.cfg.plugin:
        return
    for record in sim.scheduler.obcache_ledger.finished:
        if record.resident_tokens < 0:
            sim.worker.violate("outcome", f"{record.req_id} finished with "
                               f"{record.resident_tokens} resident tokens")  # fmt: skip
    sim.scheduler.obcache_ledger.finished.clear()


def holders(sim) -> Counter:
    """Who holds each block: requests' tables, held entries, queued copies (both ends)."""
    manager = _manager(sim)
    count: Counter = Counter()
    for blocks in manager.req_to_blocks.values():
        for b in blocks:
            if not b.is_null:
                count[b.block_id] += 1
    if sim.cfg.plugin:
        for _, blocks in sim.scheduler.obcache_prefix._held_blocks.values():
            for b in blocks:
                count[b.block_id] += 1
    for src, dst in manager._pending_cow_copies:
        count[src.block_id] += 1
        count[dst.block_id] += 1
    return count


def _refcounts(sim) -> None:
    pool = sim.pool
    count = holders(sim)
    free = 0
    for block in pool.blocks[1:]:
        if block.ref_cnt != count.get(block.block_id, 0):
            sim.worker.violate("refcount", f"block {block.block_id}: ref_cnt {block.ref_cnt}, "
                               f"{count.get(block.block_id, 0)} holders")  # fmt: skip
            return
        free += block.ref_cnt == 0
    if free != pool.get_num_free_blocks():
        sim.worker.violate("refcount", f"{free} unreferenced blocks, "
                           f"{pool.get_num_free_blocks()} in the free queue")  # fmt: skip


def learn_hashes(sim) -> None:
    """Record the stock contents each live request's block hashes stand for."""
    chains = sim.__dict__.setdefault("_chains", {})
    bs = sim.cfg.block_size
    for req_id, request in sim.scheduler.requests.items():
        hashes = request.block_hashes
        known, last, chain = chains.get(req_id, (0, None, None))
        if chain is None or len(hashes) < known or (known and hashes[known - 1] != last):
            known, chain = 0, StockChain()  # new, or its tokens changed (a streaming update)
        if len(hashes) == known:
            continue
        contents = chain.upto(request.all_token_ids, len(hashes) * bs)
        for i in range(known, len(hashes)):
            key = make_block_hash_with_group_id(hashes[i], 0)
            sim.expected_stock[key] = tuple(contents[i * bs : (i + 1) * bs])
        chains[req_id] = (len(hashes), hashes[-1], chain)
    for req_id in [r for r in chains if r not in sim.scheduler.requests]:
        del chains[req_id]


def _registered(sim) -> None:
    if not sim.cfg.prefix_caching:
        return
    learn_hashes(sim)
    slots = sim.worker.slots
    for key, blocks in sim.pool.cached_block_hash_to_block._cache.items():
        if is_tag(key):
            continue
        want = sim.expected_stock.get(key)
        for block in blocks.values() if isinstance(blocks, dict) else (blocks,):
            if want is None:
                sim.worker.violate("registered", f"block {block.block_id} carries a hash no "
                                   "request's tokens have")  # fmt: skip
                return
            if tuple(slots[block.block_id]) != want:
                sim.worker.violate("registered", f"block {block.block_id} is registered under "
                                   "a token hash without those tokens' stock KV")  # fmt: skip
                return


def _tables(sim, out) -> None:
    manager = _manager(sim)
    ledger = getattr(sim.scheduler, "obcache_ledger", None)
    states = sim.worker.eviction.states if sim.worker.eviction is not None else {}
    bs = sim.cfg.block_size
    for req_id in out.num_scheduled_tokens:
        request = sim.scheduler.requests.get(req_id)
        w = sim.worker.requests.get(req_id)
        if request is None or w is None or request.status != RequestStatus.RUNNING:
            continue
        blocks = manager.req_to_blocks.get(req_id, [])
        record = ledger.get(req_id) if ledger is not None else None
        dead = record.dead if record is not None else 0
        if record is not None:
            state = states.get(req_id)
            if state is not None and state.dead != dead or w.cache.dead != dead:
                sim.worker.violate("ledger", f"{req_id}: scheduler dead {dead}, worker "
                                   f"{None if state is None else state.dead}, cache "
                                   f"{w.cache.dead}")  # fmt: skip
        live = -(-request.num_computed_tokens // bs)
        for i, block in enumerate(blocks[:live]):
            if (i < dead) != block.is_null:
                what = "null" if block.is_null else block.block_id
                sim.worker.violate("table", f"{req_id}: block {i} is {what}, dead {dead}")
                return
        ids = [b.block_id for b in blocks[dead:]]
        if w.block_ids[dead : dead + len(ids)] != ids:
            sim.worker.violate("table", f"{req_id}: scheduler blocks {ids}, worker "
                               f"{w.block_ids[dead:]}")  # fmt: skip


def _runnable_waiting(scheduler) -> list:
    queued = list(scheduler.waiting) + list(scheduler.kv_holding_waiting)
    return [r for r in queued if r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)]


def reclaimable(sim) -> int:
    return sim.scheduler.obcache_prefix.reclaimable_blocks if sim.cfg.plugin else 0


def _liveness(sim, out) -> None:
    fitting = _idle_and_fitting(sim, out)
    # Admitted within one step: a copy queued by the last step may pin blocks during this
    # one's allocations (the copy runs, and its blocks come back, as the step runs).
    sim._idle_fitting = getattr(sim, "_idle_fitting", 0) + 1 if fitting else 0
    if sim._idle_fitting >= 2:
        sim.worker.violate("stall", f"nothing ran for two steps: {fitting}")


def _idle_and_fitting(sim, out) -> str | None:
    """Why the step was idle although the head of the queue fits, or None."""
    scheduler = sim.scheduler
    if out.total_num_scheduled_tokens or scheduler.running:
        return None
    waiting = _runnable_waiting(scheduler)
    if not waiting or any(
        r.status == RequestStatus.WAITING_FOR_STREAMING_REQ for r in scheduler.requests.values()
    ):
        return None
    usable = sim.cfg.num_blocks - 1
    head = waiting[0]
    ledger = getattr(scheduler, "obcache_ledger", None)
    record = ledger.get(head.request_id) if ledger is not None else None
    bounded = record is not None and (record.prefill_evicts or record.on_pressure)
    if not bounded and -(-head.num_tokens // sim.cfg.block_size) > usable:
        return None  # it can never fit (a streaming session grown past the pool: stock too)
    free = sim.pool.get_num_free_blocks()
    if free + reclaimable(sim) < usable:
        return None
    return (f"{len(waiting)} waiting (head {head.request_id}), {free} free of {usable} and "
            f"{usable - free} held by entries nobody reads")  # fmt: skip


def check_end(sim, max_steps: int = 2000) -> None:
    """Stop every request, let the engine drain, then nothing may be left in use."""
    scheduler = sim.scheduler
    live = list(scheduler.requests)
    for req_id in live:
        sim.abort(req_id)
    if not sim.drain(max_steps):
        sim.worker.violate("undrained", f"{list(scheduler.requests)} never finished")
        return
    sim.step()  # the worker learns the last finished ids
    pool = sim.pool
    usable = sim.cfg.num_blocks - 1
    if not sim.reset():
        used = usable - pool.get_num_free_blocks()
        sim.worker.violate("leak", f"reset_prefix_cache refused: {used} blocks in use "
                           f"({dict(holders(sim))})")  # fmt: skip
        return
    if pool.get_num_free_blocks() != usable:
        sim.worker.violate("leak", f"{usable - pool.get_num_free_blocks()} blocks in use")
    if sim.cfg.plugin:
        leftovers = {
            "ledger": list(scheduler.obcache_ledger.requests),
            "worker": list(sim.worker.eviction.states),
            "held": len(scheduler.obcache_prefix.held),
            "copying": len(scheduler.obcache_prefix._copying),
        }
        if any(leftovers.values()):
            sim.worker.violate("leak", f"state left behind: {leftovers}")
