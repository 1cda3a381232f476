"""The ledger's decisions applied to vLLM's KV-cache manager (EngineCore process).

Every place where obcache-vllm touches vLLM's block accounting for a budgeted request is here,
each decided by the request's :class:`~obcache_vllm.eviction.ledger.RequestBlocks`:

* registration: ``KVCacheCoordinator.cache_blocks`` of a budgeted request commits only what
  the ledger says is registrable (stock KV below the write floor);
* copy-on-write at admission: a prefix hit's blocks that the request's compaction will write
  are swapped for private copies before the worker ever sees them (vLLM's own
  ``SingleTypeKVCacheManager._apply_cow``: the copy runs before the step's forward pass);
* admission: a ``kv_prefill_evict`` request is admitted by its bounded peak, not its whole
  prompt (vLLM's ``full_sequence_must_fit`` gate of ``KVCacheManager.allocate_slots``), after
  held entries gave way as they do for any request; on a hybrid model the peak adds what the
  sliding-window groups hold at most (vLLM's ``max_admission_blocks_per_request``); a
  ``kv_when: pressure`` request as stock vLLM would admit it, else by its bounded peak, and
  then compressed while prefilled;
* freeing: dead head blocks go back to the pool as vLLM's sliding window frees them
  (``SingleTypeKVCacheManager._remove_blocks_in_range``: null blocks in place, ref counts
  decremented, so a block another request shares stays with it);
* writability: a block that receives kept tokens must be the request's alone and unhashed
  (``BlockPool.is_block_writable``);
* blocks in flight: a block registered in the prefix cache during this ``schedule()`` holds
  KV only after this step's forward pass. vLLM reads such blocks in the same forward pass
  (safe: each layer writes before it attends), but a copy runs *before* the forward pass, so
  a copy-on-write from one would copy garbage (:attr:`PoolAdapter.in_flight`, used by the
  prefix adapter to trim a budgeted request's hit);
* copy batches: vLLM runs a step's block copies as one gather then one scatter
  (``copy_kv_cache_blocks_inplace``: ``blocks[dst] = blocks[src]``), so a copy whose source
  is another copy's destination in the same batch would read the old contents.
  :meth:`PoolAdapter.take_kv_cache_block_copies` rewrites such chains to read the first
  source (``KVCacheManager.take_kv_cache_block_copies``).

vLLM builds its ``KVCacheManager`` inside ``Scheduler.__init__``, so the wrappers are bound to
that instance (each an ``instance`` row of :data:`obcache_vllm.vllm_ext.seams.REGISTRY`,
installed by :func:`~obcache_vllm.vllm_ext.seams.bind`).
"""

from __future__ import annotations

from obcache_vllm.eviction.copies import resolve_copy_chains
from obcache_vllm.eviction.ledger import BlockLedger
from obcache_vllm.eviction.messages import EvictionOrder
from obcache_vllm.vllm_ext import seams


class BlockNotWritableError(RuntimeError):
    """A block that would receive kept tokens is shared or in the prefix cache."""


class PoolAdapter:
    """vLLM's KV-cache manager as the block ledger sees it (one per scheduler)."""

    def __init__(self, kv_cache_manager, ledger: BlockLedger, max_num_batched_tokens: int,
                 group_index: int = 0, window_blocks: int = 0) -> None:  # fmt: skip
        self.manager = kv_cache_manager
        self.ledger = ledger
        self.chunk = max_num_batched_tokens
        # The group budgets evict in (:mod:`obcache_vllm.vllm_ext.groups`): the only one, or a
        # hybrid model's global layers; its sliding-window groups are vLLM's alone.
        self.managers = kv_cache_manager.coordinator.single_type_managers
        self.group_index = group_index
        self.group = self.managers[group_index]
        # A hybrid model's sliding-window groups: the most blocks a request holds in all of
        # them at once (vLLM's own admission cap per group), added to a bounded peak.
        self.window_blocks = window_blocks
        self.pool = kv_cache_manager.block_pool
        self.pressure_admissions = 0  # kv_when "pressure" requests admitted compressed
        # Set by the prefix adapter: releases a held compressed entry for a request whose
        # allocation failed (PrefixAdapter.reclaim); None without prefix caching.
        self.reclaim = None
        # Set by the prefix adapter: called when vLLM takes the queued copies (they run with
        # the step being scheduled).
        self.copies_taken = None
        # Block ids registered in the prefix cache during the current schedule() (their KV is
        # written by this step's forward pass); cleared by new_step().
        self.in_flight: set[int] = set()
        coordinator = kv_cache_manager.coordinator
        self._cache_blocks = coordinator.cache_blocks
        self._allocate_slots = kv_cache_manager.allocate_slots
        self._take_copies = kv_cache_manager.take_kv_cache_block_copies
        seams.bind(coordinator, "KVCacheCoordinator.cache_blocks", self.cache_blocks)
        seams.bind(kv_cache_manager, "KVCacheManager.allocate_slots", self.allocate_slots)
        seams.bind(kv_cache_manager, "KVCacheManager.take_kv_cache_block_copies",
                   self.take_kv_cache_block_copies)  # fmt: skip

    def new_step(self) -> None:
        """A schedule() begins: blocks registered before it hold their KV (synchronous
        scheduling: the previous step's forward pass has run)."""
        self.in_flight.clear()

    # -- registration ------------------------------------------------------------------------
    def cache_blocks(self, request, num_computed_tokens: int) -> None:
        """``KVCacheCoordinator.cache_blocks`` as the ledger allows it."""
        blocks = self.ledger.get(request.request_id)
        if blocks is not None:
            num_computed_tokens = blocks.registrable(num_computed_tokens)
            if num_computed_tokens < self.group.block_size:
                return
        req_id = request.request_id
        before = self.group.num_cached_block.get(req_id, 0)
        self._cache_blocks(request, num_computed_tokens)
        after = self.group.num_cached_block.get(req_id, 0)
        if after > before:  # registered now, computed by this step's forward pass (or earlier)
            req_blocks = self.group.req_to_blocks.get(req_id, ())
            self.in_flight.update(b.block_id for b in req_blocks[before:after] if not b.is_null)

    # -- the step's block copies ---------------------------------------------------------------
    def take_kv_cache_block_copies(self):
        """``KVCacheManager.take_kv_cache_block_copies`` with chains resolved: a copy whose
        source is an earlier copy's destination in the same batch reads that copy's source
        instead (what the destination will hold once the batch has run). The retained
        blocks (both ends of every pair, released by vLLM after the copy) are unchanged."""
        copies, retained = self._take_copies()
        if self.copies_taken is not None:
            self.copies_taken()
        return resolve_copy_chains(copies), retained

    # -- admission ---------------------------------------------------------------------------
    def allocate_slots(self, request, num_new_tokens, *args, **kwargs):
        """``KVCacheManager.allocate_slots``, for a budgeted request as the ledger admits it.

        A waiting ``kv_prefill_evict`` request must fit its bounded peak, not its whole prompt
        (:meth:`_fits_bounded`: held entries give way first, as they would for a stock
        request); a waiting ``kv_when: pressure`` request is tried as stock first, and only
        if that fails is it admitted compressed while prefilled, by the same rule. A switch
        to admission under pressure that is not admitted is withdrawn: the request is stock
        again at its next try. A waiting request that is not admitted keeps nothing of its
        lookup (:meth:`~obcache_vllm.eviction.ledger.RequestBlocks.unadopt`: vLLM looks it
        up again next time, and an abort before then reports a request that held nothing).
        """
        blocks = self.ledger.get(request.request_id)
        if (
            blocks is None
            or blocks.disabled is not None
            or not kwargs.get("full_sequence_must_fit")
            or not (blocks.prefill_evicts or blocks.on_pressure)
        ):
            allocated = self._allocate(request, num_new_tokens, blocks, args, kwargs)
            return self._settle(request, blocks, allocated)
        switched = False
        if blocks.on_pressure:  # as stock first; compressed while prefilled if only that fits
            allocated = self._allocate(request, num_new_tokens, blocks, args, kwargs)
            if allocated is not None:
                return allocated
            blocks.admit_under_pressure()
            switched = True
        kwargs = {**kwargs, "full_sequence_must_fit": False}
        allocated = None
        if self._fits_bounded(request, blocks, kwargs):
            allocated = self._allocate(request, num_new_tokens, blocks, args, kwargs)
        if switched:
            if allocated is None:
                blocks.withdraw_pressure_admission()
            else:
                self.pressure_admissions += 1
        return self._settle(request, blocks, allocated)

    def _settle(self, request, blocks, allocated):
        if allocated is None and blocks is not None and not self.group.req_to_blocks.get(
            request.request_id
        ):
            blocks.unadopt()  # not admitted: its lookup is void (see allocate_slots)
        return allocated

    def _fits_bounded(self, request, blocks, kwargs) -> bool:
        """Whether a request admitted by its bounded peak fits now: the peak, plus the blocks
        its prefix hit must copy, within the free blocks once held entries have given way
        (:meth:`PrefixAdapter.reclaim`: every hold when nothing runs, else those above the
        base share). Never when a copy would read a block this step's forward pass writes
        (:attr:`in_flight`): the copy runs before it (stock allocation may still take such a
        hit: it reads the block in the same forward pass, after the write)."""
        copies = self._copies_needed(request, blocks, kwargs)
        if copies and self.in_flight:
            hit_blocks = kwargs["new_computed_blocks"].blocks[self.group_index]
            if any(hit_blocks[i].block_id in self.in_flight for i in copies):
                return False
        peak = blocks.peak_blocks(request.sampling_params.max_tokens or 1, self.chunk)
        peak += self.window_blocks
        need = peak + len(copies) - self.live_blocks(request.request_id, every_group=True)
        while need > self.pool.get_num_free_blocks():
            if self.reclaim is None or not self.reclaim(request):
                return False
        return True

    def _allocate(self, request, num_new_tokens, blocks, args, kwargs):
        """vLLM's allocation, with the copy-on-write the ledger asks for at admission."""
        copies = self._copies_needed(request, blocks, kwargs)
        if copies:  # the copies' blocks must be left free after the allocation
            kwargs = {**kwargs, "reserved_blocks": kwargs.get("reserved_blocks", 0) + len(copies)}
        allocated = self._allocate_slots(request, num_new_tokens, *args, **kwargs)
        # Held entries give way before vLLM preempts (or a waiting request could never run):
        # a failed allocate_slots changed nothing, so it is simply tried again.
        while allocated is None and self.reclaim is not None and self.reclaim(request):
            allocated = self._allocate_slots(request, num_new_tokens, *args, **kwargs)
        if allocated is not None and copies:
            req_blocks = self.group.req_to_blocks[request.request_id]
            for index in copies:
                copy = self.pool.get_new_blocks(1)[0]
                self.group._apply_cow(request.request_id, index, req_blocks[index], copy)
                if self.group.records_new_block_ids:
                    self.group.new_block_ids.append(copy.block_id)
        return allocated

    def _copies_needed(self, request, blocks, kwargs) -> list[int]:
        """Which blocks of a new request's prefix hit it must copy (see the ledger)."""
        hit = kwargs.get("new_computed_blocks")
        if blocks is None or hit is None or self.group.req_to_blocks.get(request.request_id):
            return []
        hit_blocks = hit.blocks[self.group_index]
        full = kwargs.get("num_new_computed_tokens", 0) // self.group.block_size
        return [i for i in blocks.copy_on_write(full) if not hit_blocks[i].is_null]

    # -- the request's blocks ----------------------------------------------------------------
    def next_step_blocks(self, request) -> int:
        """Blocks ``request`` allocates in its next step (as vLLM's allocate_slots counts):
        its next chunk, or one more token; on a hybrid model in every group."""
        remaining = request.num_tokens - request.num_computed_tokens
        chunk = min(max(remaining, 1), self.chunk)
        bs = self.group.block_size
        need = -(-(request.num_computed_tokens + chunk) // bs)
        # A hybrid model's sliding-window groups allocate the same new blocks (an upper bound:
        # vLLM frees the blocks behind each window before it allocates).
        return sum(max(0, need - len(m.req_to_blocks.get(request.request_id, ())))
                   for m in self.managers)  # fmt: skip

    def sole_owner(self, req_id: str, first: int, last: int) -> bool:
        """Whether blocks ``[first, last)`` of the request are held by it alone (a hash
        allowed: :meth:`PrefixAdapter.release_for_pressure` drops it)."""
        blocks = self.group.req_to_blocks.get(req_id, ())
        return all(not b.is_null and b.ref_cnt == 1 for b in blocks[first:last])

    @property
    def hybrid(self) -> bool:
        """Several groups: the others a hybrid model's sliding-window layers."""
        return len(self.managers) > 1

    def live_blocks(self, req_id: str, every_group: bool = False) -> int:
        """Blocks the request holds in the pool (null blocks excluded): in the group budgets
        evict in, or with ``every_group`` in all of them (a hybrid model's sliding windows)."""
        managers = self.managers if every_group else (self.group,)
        return sum(1 for m in managers for b in m.req_to_blocks.get(req_id, ()) if not b.is_null)

    def free_head(self, req_id: str, first: int, last: int) -> None:
        """Return blocks ``[first, last)`` of the request to the pool (null blocks in place)."""
        self.group._remove_blocks_in_range(req_id, first, last)

    def check_writable(self, req_id: str, order: EvictionOrder) -> None:
        """Every block that receives kept tokens must be this request's alone and unhashed."""
        blocks = self.group.req_to_blocks[req_id]
        last = -(-order.logical_len // order.block_size)
        for block in blocks[order.write_from : last]:
            if not self.pool.is_block_writable(block):
                raise BlockNotWritableError(
                    f"request {req_id}: block {block.block_id} is shared or cached; "
                    "refusing to compact into it"
                )

