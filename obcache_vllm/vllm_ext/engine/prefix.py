"""Budgeted requests and vLLM's prefix cache (EngineCore process): reads, entries, KV events.

What a budgeted request does with the prefix cache (each decision is the ledger's,
:class:`~obcache_vllm.eviction.ledger.RequestBlocks`; this module applies it to vLLM's
objects):

* **Reads.** ``Scheduler._get_local_prefix_cache_hit`` (the one lookup of a new or resumed
  request): a request whose pipeline allows an exact hit takes vLLM's ordinary hit trimmed to
  :meth:`~obcache_vllm.eviction.ledger.RequestBlocks.exact_hit` (vLLM's own
  ``truncate_computed_blocks``). Hit blocks its compaction will write are copied first
  (copy-on-write at admission, :meth:`.blocks.PoolAdapter.allocate_slots`), so compaction
  never writes a block another request can read; dead hit blocks are freed by ref count and
  stay cached for their other readers.
* **Compressed entries** (:mod:`obcache_vllm.eviction.entries`): a ``kv_compress_at = k``
  request's compressed first-k cache is copied into cached blocks right after its eviction
  (vLLM's block-copy queue, run by the worker before the next forward pass; both ends are
  held until then); a ``kv_session`` request's final cache is taken over when it finishes. A
  later request with the same tokens, options and cache salt adopts an entry as a prefix hit
  ``[null] * dead + live`` (vLLM copies a partial last block itself; a copy chained on the
  entry's own pending copy is resolved by :meth:`.blocks.PoolAdapter.take_kv_cache_block_copies`).
  Entries are held out of the LRU within ``OBCACHE_ENTRY_POOL_SHARE_MAX`` of the pool (one
  reference per block, :class:`~obcache_vllm.eviction.entries.HeldEntries`) and given up, the
  one whose next read is predicted furthest away first (``OBCACHE_ENTRY_VICTIMS``), when an
  allocation fails for a running request (before vLLM preempts), for a waiting one while more
  than ``OBCACHE_ENTRY_POOL_SHARE`` is held, or for a waiting one with nothing running
  (:meth:`PrefixAdapter.reclaim`, called by :meth:`.blocks.PoolAdapter.allocate_slots`).
  A new entry's copy short of free blocks takes the room of the held entries that rank
  before it in that order (:meth:`PrefixAdapter._make_room`), never a running request's.
* **KV events** (``--kv-events-config``): registered blocks hold stock KV and are published
  by vLLM as usual; entry blocks carry tags (:func:`~obcache_vllm.eviction.entries.tag`)
  that no token lookup can match, are never published, and their ``BlockRemoved`` events are
  dropped (``BlockPool._emit_block_removed_events``). ``reset_prefix_cache`` clears the index
  with vLLM's hashes (and vLLM publishes ``AllBlocksCleared``).

Entries follow ``--enable-prefix-caching``: without it there are no cached blocks, so no
reads and no entries.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections import OrderedDict

from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

from obcache_vllm.config import entry_pool_share, entry_pool_share_max, entry_victims
from obcache_vllm.eviction.entries import Entry, EntryIndex, EntryKey, HeldEntries, is_tag, tag
from obcache_vllm.eviction.ledger import CacheStart, RequestBlocks
from obcache_vllm.vllm_ext import seams

logger = logging.getLogger(__name__)

def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class PrefixAdapter:
    """One scheduler's view of vLLM's prefix cache for budgeted requests."""

    def __init__(self, scheduler, pool_adapter, capacity: int = 512) -> None:
        self.scheduler = scheduler
        self.manager = scheduler.kv_cache_manager
        self.pool = self.manager.block_pool
        self.pool_adapter = pool_adapter
        self.group = pool_adapter.group
        self.block_size = pool_adapter.group.block_size
        self.group_id = pool_adapter.group_index  # the group of the hashes entries carry
        # A hybrid model's budgeted requests neither read nor leave entries: a hit spans every
        # group, and a sliding-window group's part cannot be trimmed or copied as the global
        # group's (admission refuses the options that leave entries; reads are empty here).
        self.enabled = bool(self.manager.enable_caching) and not pool_adapter.hybrid and (
            self.pool.hash_block_size == self.block_size
        )
        self.entries = EntryIndex(capacity)
        usable = self.pool.num_gpu_blocks - 1
        self.held = HeldEntries(
            int(entry_pool_share_max() * usable),
            base=int(entry_pool_share() * usable),
            victims=entry_victims(),
        )
        self._held_blocks: dict[int, list] = {}  # entry id -> the blocks it holds a ref on
        # An entry held through another's hold (its blocks are the other's: _expose_point)
        # -> that entry, so adopting the first counts as a read of the second.
        self._holder: OrderedDict[int, int] = OrderedDict()
        # Destination block id -> its entry, for entry copies queued and not yet taken by
        # vLLM's schedule() (between two steps; see drop_pending_copies).
        self._copying: dict[int, Entry] = {}
        # Entries made since the last take_made() (kept only for the KV oracle).
        self.record_made = False
        self._made: list[Entry] = []
        # Cumulative counters for metrics: (kind, what) -> count, what in hit, miss, created,
        # evicted, released, reused_tokens (kind "stock": preserved blocks).
        self.counts: dict[tuple[str, str], int] = {}
        if self.enabled:
            _filter_entry_events(self.pool)
            pool_adapter.reclaim = self.reclaim
            pool_adapter.copies_taken = self._copying.clear
            manager, index = self.manager, self

            reset = manager.reset_prefix_cache

            @functools.wraps(reset)
            def reset_prefix_cache():
                index.release_all()  # vLLM resets only a pool that no one holds
                index.drop_pending_copies()  # nor one with copies queued between two steps
                done = reset()
                if done:
                    index.entries.clear()  # vLLM removed every hash, tags included
                return done

            seams.bind(manager, "KVCacheManager.reset_prefix_cache", reset_prefix_cache)

    def count(self, kind: str, what: str, amount: int = 1) -> None:
        self.counts[(kind, what)] = self.counts.get((kind, what), 0) + amount

    # -- keys --------------------------------------------------------------------------------
    def key_at(self, request, blocks: RequestBlocks, kind: str, tokens: int) -> EntryKey:
        """The entry key of ``request``'s first ``tokens`` tokens."""
        full = tokens // self.block_size
        prefix = bytes(request.block_hashes[full - 1]) if full else None
        lora = request.lora_request.name if request.lora_request else None
        # vLLM's chained hash covers multimodal inputs in full blocks only: the tail's tokens
        # may be placeholders of any image, so every input that starts in the prefix counts.
        mm = tuple(
            f.identifier
            for f in getattr(request, "mm_features", None) or ()
            if f.mm_position.offset < tokens
        )
        return EntryKey(
            kind=kind,
            tokens=tokens,
            prefix_hash=prefix,
            tail=tuple(request.all_token_ids[full * self.block_size : tokens]),
            options=blocks.entry_options(kind),
            salt=request.cache_salt,
            lora=lora,
            mm=mm,
        )

    def valid(self, entry: Entry) -> bool:
        """Every block of the entry still carries the hash it had when the entry was made."""
        blocks = self.pool.blocks
        return all(
            blocks[b].block_hash == h for b, h in zip(entry.block_ids, entry.hashes, strict=True)
        )

    # -- reads -------------------------------------------------------------------------------
    def lookup(self, request, blocks: RequestBlocks, ordinary):
        """The prefix hit of a budgeted request: an entry to adopt, or the exact part of
        vLLM's ordinary hit (``ordinary()``: the stock lookup). Returns vLLM's tuple.

        Without side effects that outlive a failed allocation: vLLM calls this again for a
        request it could not admit, so every call starts from a request that adopted nothing
        (:meth:`RequestBlocks.unadopt`), and what it found is counted only once the request
        is admitted (:meth:`admitted`)."""
        empty = (self.manager.empty_kv_cache_blocks, 0, 0, False)
        blocks.unadopt()
        if not self.enabled or not blocks.may_read:
            return empty
        kind = blocks.entry_kind
        if kind is not None:
            hit = self._adopt(request, blocks, kind)
            if hit is not None:
                return hit
        if not blocks.reads_cache or self._only_admitted_compressed(request, blocks):
            return empty
        computed, num_local, boundary, diverged = ordinary()
        allowed = self._written(computed.blocks[self.group_id], blocks, blocks.exact_hit(num_local))
        allowed = self._affordable(request, blocks, allowed)
        if allowed < num_local:
            computed = self.manager.truncate_computed_blocks(computed, allowed)
            num_local = allowed
        if num_local:
            blocks.adopt(CacheStart("hit", num_local))
        return computed, num_local, boundary if num_local else 0, diverged and bool(num_local)

    def _written(self, hit_blocks, blocks: RequestBlocks, allowed: int) -> int:
        """``allowed`` hit tokens, trimmed before the first block the request would copy
        (:meth:`RequestBlocks.copy_on_write`) whose KV this very step computes: the copy
        runs before the forward pass (see :mod:`obcache_vllm.eviction.copies`). The request
        computes those tokens itself, as it would without the prefix cache."""
        in_flight = self.pool_adapter.in_flight
        if not in_flight:
            return allowed
        for index in blocks.copy_on_write(allowed // self.block_size):
            if hit_blocks[index].block_id in in_flight:
                return index * self.block_size
        return allowed

    def _only_admitted_compressed(self, request, blocks: RequestBlocks) -> bool:
        """A ``kv_when: pressure`` request whose whole sequence exceeds the pool is only ever
        admitted compressed while prefilled, which writes from its first block: every block
        of a hit would have to be copied, and the copies with its peak may never fit. It
        computes its prompt itself, as a ``kv_prefill_evict`` request does."""
        usable = self.pool.num_gpu_blocks - 1
        return blocks.on_pressure and _cdiv(request.num_tokens, self.block_size) > usable

    def _affordable(self, request, blocks: RequestBlocks, allowed: int) -> int:
        """``allowed`` hit tokens, or only those below the write floor (no copies) when the
        request's prompt plus the copies of its hit could not fit even an empty pool
        (:meth:`_fits_empty_pool`; the stock request in its place always fits). An entry
        is adopted under the same rule (:meth:`_adopt`)."""
        bs = self.block_size
        copies = len(blocks.copy_on_write(allowed // bs))
        if not self._fits_empty_pool(request, 0, copies):
            return min(allowed, blocks.write_floor * bs)
        return allowed

    def _fits_empty_pool(self, request, dead: int, copies: int) -> bool:
        """Whether ``request``, starting with ``dead`` null head blocks and copying
        ``copies`` blocks of its hit (each beside its shared original until the copy has
        run), fits the whole pool: otherwise it could never be admitted."""
        need = _cdiv(request.num_tokens, self.block_size) - dead + copies
        return need <= self.pool.num_gpu_blocks - 1

    def admitted(self, blocks: RequestBlocks) -> None:
        """The request was admitted (its allocation succeeded): count what its lookup found;
        an entry it adopted is now in use (the last held to be released, no longer
        tentative). Nothing of this happens for a lookup whose request is not admitted."""
        start = blocks.start
        found, blocks.lookup = blocks.lookup, None
        if found is not None and not blocks.read_counted:
            # one access of the entries (hit or miss); a request admitted again after a
            # preemption is the same access
            blocks.read_counted = True
            self.held.tick()
            if start is not None and start.entry_id is not None:
                self.held.used(self._holder.get(start.entry_id, start.entry_id))
        elif start is not None and start.entry_id is not None:
            self.held.used_again(self._holder.get(start.entry_id, start.entry_id))
        if found is None:
            return
        kind, hit = found
        if hit is None:
            self.count(kind, "miss")
        else:
            self.count(kind, "hit")
            self.count(kind, "reused_tokens", hit)

    def _adopt(self, request, blocks: RequestBlocks, kind: str):
        at_most = request.num_tokens - 1  # vLLM recomputes at least the last token
        entry, stale = self._longest(request, blocks, kind, at_most)
        if stale:  # wanted, but its blocks were reused: the hold policy learns of it (the
            # longest only: shorter ones are its ancestors, which a turn's entry supersedes)
            self.held.missed(self._holder.get(stale[0].entry_id, stale[0].entry_id))
            self.count(stale[0].key.kind, "wanted_again")
        self._release(stale, evicted=True)
        if entry is None:
            blocks.lookup = (kind, None)
            return None
        blocks.lookup = (kind, entry.tokens)
        hit = [self.pool.null_block] * entry.dead + [self.pool.blocks[b] for b in entry.block_ids]
        blocks.adopt(CacheStart(kind, entry.tokens, entry.dead, depth=entry.depth,
                                kept_prompt=entry.kept_prompt, entry_id=entry.entry_id,
                                donor=entry.donor, chosen=entry.chosen,
                                error=entry.error, head_layout=entry.head_layout))  # fmt: skip
        full = entry.tokens // self.block_size
        copies = sum(1 for i in blocks.copy_on_write(full) if i >= entry.dead)
        copies += 1 if entry.tokens % self.block_size else 0  # vLLM copies a partial last block
        if not self._fits_empty_pool(request, entry.dead, copies):
            blocks.unadopt()  # computed afresh: it always fits (the entry is no use here)
            blocks.lookup = (kind, None)
            return None
        computed = self.manager.create_kv_cache_blocks((hit,))
        return computed, entry.tokens, 0, False

    def _longest(self, request, blocks, kind, at_most):
        if kind == "compress_at":
            if blocks.point > at_most:
                return None, []
            key = self.key_at(request, blocks, kind, blocks.point)
            entry = self.entries.get(key)
            if entry is None:
                return None, []
            if self.valid(entry):
                return entry, []
            self.entries.remove(entry)
            return None, [entry]
        return self.entries.longest(
            kind,
            blocks.entry_options(kind),
            at_most,
            lambda n: self.key_at(request, blocks, kind, n),
            self.valid,
        )

    # -- stock blocks a compaction overwrites ------------------------------------------------
    def with_preserved(self, request, blocks: RequestBlocks, order):
        """``order`` with spare blocks for the stock KV it overwrites (:meth:`RequestBlocks.
        preservable`), when the pool has them; the worker copies into them before compacting,
        :meth:`settle_preserved` registers them (addressable by their tokens: stock KV)."""
        if not self.enabled:
            return order
        return self._with_spares(order, blocks.preservable(order))

    def _with_spares(self, order, indices: range):
        """``order`` with a spare block for each block index in ``indices`` (copied into by
        the worker before it compacts, registered by :meth:`settle_preserved`), or as it is
        when there are none to preserve or the pool has too few free blocks."""
        if not indices or len(indices) > self.pool.get_num_free_blocks():
            return order
        spare = self.pool.get_new_blocks(len(indices))
        pairs = tuple((i, b.block_id) for i, b in zip(indices, spare, strict=True))
        return dataclasses.replace(order, preserve=pairs)

    def release_for_pressure(self, request, order):
        """``order`` compresses a ``kv_when: pressure`` request that ran as stock vLLM: it
        registered its blocks as stock does, so the ones the order writes (the planner chose
        it only if it holds them alone) leave the prefix cache now, before their KV changes;
        where the pool has the blocks, their stock KV is copied into spares that are
        registered in their place after the step (:meth:`settle_preserved`), so the prefix
        cache keeps what stock vLLM would. Returns the order, with its spares. On a hybrid
        model (no entries, :attr:`enabled` off) the hashes still leave, without spares: the
        prefix cache loses those blocks."""
        if not self.manager.enable_caching:
            return order
        bs = self.block_size
        req_blocks = self.group.req_to_blocks[request.request_id]
        full = min(order.logical_len // bs, len(req_blocks))
        hashed = [i for i in range(order.write_from, full) if req_blocks[i].block_hash is not None]
        if not hashed:
            return order
        self.pool.evict_blocks({req_blocks[i].block_id for i in hashed})
        if not self.enabled or len(request.block_hashes) < full:
            return order
        # The pool is short (that is why it compresses): without spare blocks they are dropped.
        return self._with_spares(order, range(hashed[0], full))

    def settle_preserved(self, request, order, applied: bool) -> None:
        """Register the spare blocks of an applied order, then release them to the pool (as
        cached blocks); an order not applied only releases them."""
        spare = [self.pool.blocks[b] for _, b in order.preserve]
        if applied and request is not None:
            first, last = order.preserve[0][0], order.preserve[-1][0] + 1
            padded = [self.pool.null_block] * first + spare
            self.pool.cache_full_blocks(request, padded, first, last, self.block_size,
                                        self.group_id)  # fmt: skip
            self.count("stock", "preserved", len(spare))
        self.pool.free_blocks(spare)

    # -- entries -----------------------------------------------------------------------------
    def donate_copy(self, request, blocks: RequestBlocks) -> Entry | None:
        """A ``kv_compress_at`` request just compressed its first k tokens: copy its live
        blocks into new cached blocks (the request keeps writing its own)."""
        if not self.enabled:
            return None
        req_blocks = self.group.req_to_blocks[request.request_id]
        tokens = blocks.point
        src = req_blocks[blocks.dead : _cdiv(tokens, self.block_size)]
        if not src or any(b.is_null for b in src):
            return None
        running = sum(self.pool_adapter.next_step_blocks(r) for r in self.scheduler.running)
        short = len(src) + running - self.pool.get_num_free_blocks()
        if short > 0 and not self._make_room(short):
            # no entry rather than taking room a running request needs next, or the room of
            # held entries predicted to be read sooner than a new one
            return None
        dst = self.pool.get_new_blocks(len(src))
        entry_id = self.entries.new_id()
        hashes = []
        for i, block in enumerate(dst):
            key = make_block_hash_with_group_id(tag(entry_id, i), self.group_id)
            self.pool._insert_block_hash(key, block, num_tokens=None)
            hashes.append(key)
        # vLLM's copy queue: drained by the next schedule(), run by the worker before the next
        # forward pass; both ends stay held until then (the drain frees one ref of each).
        self.pool.touch(src)
        self.group._pending_cow_copies.extend(zip(src, dst, strict=True))
        entry = Entry(
            key=self.key_at(request, blocks, "compress_at", tokens),
            entry_id=entry_id,
            block_ids=tuple(b.block_id for b in dst),
            hashes=tuple(hashes),
            dead=blocks.dead,
            kept_prompt=tokens - blocks.dead * self.block_size,
            donor=request.request_id,
            source_ids=tuple(b.block_id for b in src),
            chosen=blocks.chosen,
        )
        for block in dst:
            self._copying[block.block_id] = entry
        self._insert(entry, dst)
        return entry

    def _make_room(self, short: int) -> bool:
        """Free ``short`` blocks for a new entry's copy by releasing the held entries that rank
        before a new entry (:meth:`HeldEntries.ahead_of_new`: overdue, tentative, or predicted
        to be read later than a new entry), first in release order; none is released unless
        enough are. A block is freed when every reference on it is a released hold (a running
        adopter or a pending copy keeps it). Without this, entries that no request reads any
        more keep every new document from leaving one once they fill the pool's spare room."""
        victims = []
        for entry_id in self.held.ahead_of_new():
            if entry_id not in self._held_blocks:
                continue
            victims.append(entry_id)
            if self._freed_by(victims) >= short:
                for victim in victims:
                    self._unhold(victim)
                return True
        return False

    def drop_pending_copies(self) -> None:
        """Entries whose copies are still queued (made after the last step, copied by the
        next) are dropped with their copies, and both ends of each copy released: vLLM
        drains its own copies within one ``schedule()``, so between two steps only ours can
        keep references (which would fail ``reset_prefix_cache``)."""
        if not self._copying:
            return
        keep, dropped = [], []
        for pair in self.group._pending_cow_copies:
            (dropped if pair[1].block_id in self._copying else keep).append(pair)
        entries = {self._copying[dst.block_id] for _, dst in dropped}
        self._copying.clear()
        self._made = [e for e in self._made if e not in entries]
        self.group._pending_cow_copies = keep
        for entry in entries:
            self.entries.remove(entry)
        self._release(entries, evicted=False)
        self.pool.free_blocks([block for pair in dropped for block in pair])

    def donate_blocks(self, request, blocks: RequestBlocks) -> Entry | None:
        """A ``kv_session`` request finished: its final cache becomes an entry (its blocks are
        tagged before vLLM frees them, so they stay cached)."""
        if not self.enabled:
            return None
        tokens = request.num_computed_tokens
        req_blocks = self.group.req_to_blocks.get(request.request_id, [])
        live = req_blocks[blocks.dead : _cdiv(tokens, self.block_size)]
        if not live or any(b.is_null for b in live) or tokens <= blocks.dead * self.block_size:
            return None
        entry_id = self.entries.new_id()
        hashes = []
        for i, block in enumerate(live):
            if block.block_hash is None:  # this request's own block: tag it
                key = make_block_hash_with_group_id(tag(entry_id, i), self.group_id)
                self.pool._insert_block_hash(key, block, num_tokens=None)
                hashes.append(key)
            else:  # a stock block it shares with the prefix cache: keep its token hash
                hashes.append(block.block_hash)
        depth = blocks.start.depth + 1 if blocks.start and blocks.start.compressed else 1
        entry = Entry(
            key=self.key_at(request, blocks, "session", tokens),
            entry_id=entry_id,
            block_ids=tuple(b.block_id for b in live),
            hashes=tuple(hashes),
            dead=blocks.dead,
            depth=depth,
            kept_prompt=tokens - blocks.dead * self.block_size,
            donor=request.request_id,
            source_ids=tuple(b.block_id for b in live),
            error=blocks.conversation_error if blocks.options.max_error is not None else None,
            head_layout=blocks.head_layout,
        )
        parent = blocks.start.entry_id if blocks.start and blocks.start.compressed else None
        # A turn that continued its parent: the new entry holds every block the two share, so
        # the parent's hold passes to it rather than competing with it for the share (and
        # stays with the parent if the new entry is not held).
        self._insert(entry, live, tentative=blocks.options.tentative and depth == 1, like=parent,
                     replaces=parent)  # fmt: skip
        self._expose_point(request, blocks, entry)
        return entry

    def _expose_point(self, request, blocks: RequestBlocks, entry: Entry) -> None:
        """A session compressed at a point before its prompt's end (a first sighting under
        ``kv_compress_at: "auto"``, :data:`~obcache_vllm.options.FIRST_POINT`) and nowhere
        else also leaves its compressed first ``point`` tokens as a ``kv_compress_at`` entry:
        the session entry's own first blocks, under the same tags, no copy. The same prompt
        sent again resolves to that point and adopts it: exactly the cache, hence the answer,
        its first sighting had. Nothing wrote those blocks since the eviction at the point
        (no ``kv_decode``; a turn that continues either entry copies what it compacts), and
        the entry is held through the session entry's hold (:attr:`_holder`)."""
        o = blocks.options
        start = blocks.start
        if o.compress_at is None or o.decode or (start is not None and start.compressed):
            return
        point = o.compress_at
        n = _cdiv(point, self.block_size) - entry.dead
        if not 0 < n <= len(entry.block_ids):
            return
        exposed = Entry(
            key=self.key_at(request, blocks, "compress_at", point),
            entry_id=self.entries.new_id(),
            block_ids=entry.block_ids[:n],
            hashes=entry.hashes[:n],
            dead=entry.dead,
            kept_prompt=point - entry.dead * self.block_size,
            donor=request.request_id,
            source_ids=entry.source_ids[:n],
        )
        if self.record_made:
            self._made.append(exposed)
        self.count("compress_at", "created")
        self._release(self.entries.insert(exposed), evicted=True)
        self._holder[exposed.entry_id] = entry.entry_id
        while len(self._holder) > 2 * self.entries.capacity:
            self._holder.popitem(last=False)

    def take_made(self) -> list[Entry]:
        """The entries made since the last call (recorded only with ``record_made``)."""
        made, self._made = self._made, []
        return made

    def _insert(self, entry: Entry, blocks, tentative: bool = False, like: int | None = None,
                replaces: int | None = None) -> None:  # fmt: skip
        if self.record_made:
            self._made.append(entry)
        self.count(entry.key.kind, "created")
        self._release(self.entries.insert(entry), evicted=True)
        self._hold(entry, blocks, tentative, like, replaces)

    # -- held entries (eviction.entries.HeldEntries) -----------------------------------------
    def _hold(self, entry: Entry, blocks, tentative: bool = False, like: int | None = None,
              replaces: int | None = None) -> None:  # fmt: skip
        """Take one reference on each block of a new entry, within the held share (a
        tentative one as surplus; ``like``: the entry whose reuse distance it inherits;
        ``replaces``: a held entry whose hold it takes over; see :class:`HeldEntries`).
        The new entry's references are taken before the replaced one's are dropped, so a
        block the two share is never free in between."""
        released = self.held.hold(entry.entry_id, len(blocks), tentative, like, replaces)
        if released is None:
            return
        for entry_id in released:
            self._unhold(entry_id)
        self.pool.touch(blocks)
        self._held_blocks[entry.entry_id] = (entry.key.kind, list(blocks))
        if replaces is not None and replaces in self._held_blocks:
            self._unhold(replaces, counted=False)  # HeldEntries dropped it already

    @property
    def held_surplus(self) -> int:
        """Held blocks a waiting request may take: tentative ones and those above the base
        share."""
        return self.held.surplus_blocks

    @property
    def reclaimable_blocks(self) -> int:
        """Held blocks that releasing holds would return to the pool: those no request
        references (a running adopter keeps its entry's blocks whatever the hold)."""
        return self._freed_by(self._held_blocks)

    def _freed_by(self, entry_ids) -> int:
        """Blocks that releasing the holds of ``entry_ids`` would return to the pool: those
        whose every reference is one of those holds."""
        holds: dict[int, int] = {}
        blocks = {}
        for entry_id in entry_ids:
            for block in self._held_blocks[entry_id][1]:
                holds[block.block_id] = holds.get(block.block_id, 0) + 1
                blocks[block.block_id] = block
        return sum(1 for b, n in holds.items() if blocks[b].ref_cnt <= n)

    def _unhold(self, entry_id: int, *, counted: bool = True) -> None:
        """Drop the entry's references: its blocks are free, cached, and still the entry's
        until vLLM's LRU reuses one (counted as ``released``)."""
        self.held.drop(entry_id)
        kind, blocks = self._held_blocks.pop(entry_id, (None, None))
        if blocks:
            self.pool.free_blocks(blocks)
            if counted:
                self.count(kind, "released")

    @property
    def held_blocks(self) -> int:
        """Distinct blocks that compressed entries keep out of the LRU (not free, and held by
        no request once none runs). Two session entries may share blocks (a turn's entry keeps
        the blocks of the one it adopted that it did not rewrite): counted once here, once per
        entry against the share (:class:`HeldEntries`: conservative)."""
        return len({b.block_id for _, blocks in self._held_blocks.values() for b in blocks})

    def reclaim(self, request) -> bool:
        """An allocation for ``request`` failed: release the first held entry in release order if
        that is what stands between the request and the pool (a running request would be
        preempted; a waiting one, with nothing running, would never be admitted). A waiting
        request while others run gets the holds above the base share (not the entry it adopts:
        :meth:`HeldEntries.surplus_victim`), then waits for the running ones, as in stock vLLM.
        Returns whether one was released (the caller retries)."""
        from vllm.v1.request import RequestStatus

        oldest = self.held.oldest()
        if oldest is None:
            return False
        if request.status != RequestStatus.RUNNING and self.scheduler.running:
            blocks = self.scheduler.obcache_ledger.get(request.request_id)
            start = blocks.start if blocks is not None else None
            adopts = start.entry_id if start is not None else None
            victim = self.held.surplus_victim(self._holder.get(adopts, adopts))
            if victim is None:
                return False
            self._unhold(victim)
            return True
        self._unhold(oldest)
        return True

    def release_all(self) -> None:
        for entry_id in list(self._held_blocks):
            self._unhold(entry_id, counted=False)

    def _release(self, entries, *, evicted: bool) -> None:
        """Drop the tags of entries that are gone (their blocks become plain free blocks),
        except on blocks a live entry still lists: a session turn's entry keeps its
        ancestors' blocks it did not rewrite, under their tags."""
        entries = list(entries)
        if not entries:
            return
        shared = {
            (b, h)
            for live in self.entries
            for b, h in zip(live.block_ids, live.hashes, strict=True)
        }
        for entry in entries:
            self._unhold(entry.entry_id, counted=False)
            if evicted:
                self.count(entry.key.kind, "evicted")
            ids = {
                b
                for b, h in zip(entry.block_ids, entry.hashes, strict=True)
                if is_tag(h) and self.pool.blocks[b].block_hash == h and (b, h) not in shared
            }
            if ids:
                self.pool.evict_blocks(ids)


def _filter_entry_events(pool) -> None:
    """Never publish the removal of an entry tag (nothing published its storing)."""
    original = pool._emit_block_removed_events

    @functools.wraps(original)
    def _emit_block_removed_events(block_hashes):
        return original([h for h in block_hashes if not is_tag(h)])

    seams.bind(pool, "BlockPool._emit_block_removed_events", _emit_block_removed_events)
