"""Compression under pressure (``kv_when: pressure``): evict instead of preempting (EngineCore).

A ``kv_when: pressure`` request runs exactly as stock vLLM runs it while the pool has room.
vLLM's answer to a full pool is preemption: a running request loses all its blocks and is
recomputed from scratch later. Before that happens, each step (after vLLM scheduled it) the
planner looks one step ahead::

    need   = blocks the running requests take in the next step (a decode step that starts a
             new block, the next prefill chunk) + the blocks the first waiting request needs
             to be admitted
    free   = the pool's free blocks + what this step's orders free at its end
    short  = need - free

and when ``short > 0`` it orders pressure-eligible requests scheduled in this step to compress
to their budgets, the ones with the most blocks to gain first (fewest requests compressed for
the blocks needed, so the fewest lose accuracy), until ``short`` is covered. Their blocks are
back in the pool at the end of the step, before the next one allocates: the preemption is
avoided, not undone. If compression cannot cover the shortfall, vLLM preempts as usual (and a
compression that fails falls back to exactly that). A waiting pressure-eligible request whose
whole prompt does not fit but whose compressed (bounded) footprint does is admitted and
compressed while it is prefilled (:mod:`.blocks`).

Counted (``vllm:obcache_pressure_*``): compressions ordered under pressure, steps whose
shortfall of running requests the compressions covered ("preemptions avoided": the next step
would have had to preempt), and requests admitted thanks to compression.
"""

from __future__ import annotations

from dataclasses import dataclass

from obcache_vllm.eviction.ledger import BlockLedger
from obcache_vllm.eviction.messages import EvictionOrder


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PressureCounts:
    compressions: int = 0
    preemptions_avoided: int = 0
    admissions: int = 0


class PressurePlanner:
    """One scheduler's look-ahead (see the module docstring)."""

    def __init__(self, scheduler, ledger: BlockLedger, pool_adapter) -> None:
        self.scheduler = scheduler
        self.ledger = ledger
        self.pool = pool_adapter
        self.counts = PressureCounts()

    def _waiting_need(self) -> int:
        """Blocks the first waiting request needs to be admitted (0: none waits): its whole
        sequence, or for a pressure-eligible one its bounded (compressed) peak."""
        waiting = self.scheduler.waiting
        if not waiting:
            return 0
        request = waiting.peek_request()
        blocks = self.ledger.get(request.request_id)
        # A hybrid model's sliding-window groups hold at most window_blocks besides (0 else).
        if blocks is not None and blocks.on_pressure:
            max_tokens = request.sampling_params.max_tokens or 1
            return blocks.peak_blocks(max_tokens, self.pool.chunk) + self.pool.window_blocks
        return _cdiv(request.num_tokens + 1, self.pool.group.block_size) + self.pool.window_blocks

    def _gain(self, req_id: str, blocks, logical_len: int) -> int:
        """Blocks compressing ``req_id`` now would free; 0 where its order would write a block
        another request also holds (a prefix hit it shares, or one shared with it: admitted
        as stock, it took and left them as stock vLLM does)."""
        order = blocks.pressure_order(logical_len)
        if order is None:
            return 0
        last = _cdiv(order.logical_len, order.block_size)
        if not self.pool.sole_owner(req_id, order.write_from, last):
            return 0
        return order.blocks_freed

    def plan(self, output, orders: dict[str, EvictionOrder]) -> dict[str, EvictionOrder]:
        """Pressure orders for this step (``orders``: the step's other orders)."""
        eligible = [
            (req_id, blocks)
            for req_id in output.num_scheduled_tokens
            if (blocks := self.ledger.get(req_id)) is not None
            and blocks.options.when == "pressure" and req_id not in orders
        ]
        if not eligible:
            return {}
        running = [r for r in self.scheduler.running if r.request_id in output.num_scheduled_tokens]
        need_running = sum(self.pool.next_step_blocks(r) for r in running)
        # An error target's order frees at most blocks_freed: counted as none (it may keep all).
        freed = sum(o.blocks_freed for o in orders.values() if o.max_error is None)
        free = self.pool.pool.get_num_free_blocks() + freed
        # Blocks held for compressed contexts are given up before a running request is
        # preempted (PrefixAdapter.reclaim); for a waiting one while others run, only the
        # holds above the base share.
        prefix = self.scheduler.obcache_prefix
        held = prefix.reclaimable_blocks
        surplus = min(held, prefix.held_surplus)
        short_running = need_running - free - held
        room = max(0, free + surplus - need_running)
        short = max(0, short_running) + max(0, self._waiting_need() - room)
        if short <= 0:
            return {}
        requests = self.scheduler.requests
        gains = sorted(
            ((self._gain(req_id, blocks, requests[req_id].num_computed_tokens), req_id, blocks)
             for req_id, blocks in eligible),
            key=lambda item: -item[0],
        )  # fmt: skip
        if sum(g for g, _, _ in gains) < short and short_running <= 0:
            return {}  # compressing everything would still not admit the waiting request
        chosen: dict[str, EvictionOrder] = {}
        covered = 0
        for gain, req_id, blocks in gains:
            if covered >= short or gain <= 0:
                break
            order = blocks.compress_under_pressure(requests[req_id].num_computed_tokens, "running")
            if order is not None:
                chosen[req_id] = order
                covered += order.blocks_freed
        self.counts.compressions += len(chosen)
        if short_running > 0 and covered >= short_running:
            self.counts.preemptions_avoided += 1
        return chosen
