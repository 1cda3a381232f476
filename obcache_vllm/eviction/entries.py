"""Compressed contexts kept for reuse: which exist, what exactly they hold, which one matches.

A *compressed entry* is the compressed KV cache of a token prefix, left in vLLM's block pool
as cached, evictable blocks so that a later request with the same prefix and options can
start from it instead of recomputing and compressing it again:

* ``kind="compress_at"``: a ``kv_compress_at = k`` request's cache right after its eviction at
  k (copied out, since the request goes on writing its own blocks). A later request whose
  first k tokens, options and cache salt are the same adopts it and prefills only the rest:
  for query-agnostic compression that is exactly what a recompute computes.
* ``kind="session"``: a ``kv_session`` request's final cache (its prompt and output as cached:
  the last sampled token has no KV), taken over when it finishes. A later request whose
  prompt starts with exactly those tokens continues from it (:mod:`obcache_vllm.options`).

An entry holds one donor's KV: a ``compress_at`` entry is a copy of its donor's blocks; a
session entry is its donor's own blocks, some of which (those the turn did not rewrite) may be
blocks its ancestor's entry lists too, under the ancestor's tags (releasing the ancestor leaves
those tags in place). It is keyed by the exact tokens (:class:`EntryKey`: vLLM's chained block
hash of the full blocks, then the remaining token ids, and the multimodal inputs that start in
them), the options that shaped it and the cache salt / LoRA. Its blocks live in vLLM's pool as
cached blocks, each tagged with a hash of its own (:func:`tag`, never a token hash). Within a
share of the pool an entry is *held* (:class:`HeldEntries`: a reference on each block, so the
LRU cannot reuse them; given up whenever a request needs the blocks); otherwise its blocks are
free and vLLM's LRU may reuse any of them at any time: an entry is valid only while every block
still carries its tag, which the vLLM adapter checks at every lookup. The index is bounded
(:attr:`EntryIndex.capacity`); the oldest entry goes first. Plain Python.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

TAG_PREFIX = b"obcache/entry/"  # 14 bytes; vLLM's token hashes are 32-byte digests


def tag(entry_id: int, index: int) -> bytes:
    """The hash an entry's ``index``-th block carries while it belongs to the entry."""
    return TAG_PREFIX + entry_id.to_bytes(8, "big") + index.to_bytes(4, "big")


def is_tag(block_hash: bytes) -> bool:
    """Whether a (vLLM) block hash is one of ours; the group id bytes may follow."""
    return block_hash.startswith(TAG_PREFIX)


@dataclass(frozen=True)
class EntryKey:
    """Everything a request must share with an entry to adopt it.

    ``prefix_hash`` is vLLM's chained hash of the full blocks of the entry's tokens (it
    includes the cache salt, the LoRA adapter and the multimodal inputs of those blocks);
    ``tail`` the token ids after them; ``mm`` the identifiers of every multimodal input that
    starts in the entry's tokens (the tail's placeholder tokens alone do not tell two images
    apart).
    """

    kind: str
    tokens: int
    prefix_hash: bytes | None
    tail: tuple[int, ...]
    options: tuple
    salt: str | None = None
    lora: str | None = None
    mm: tuple[str, ...] = ()


@dataclass(frozen=True)
class Entry:
    """One compressed context: its live blocks ``[dead, cdiv(tokens, bs))`` in the pool.

    ``hashes[i]`` is the hash block ``block_ids[i]`` must still carry (its :func:`tag`, or
    the token hash of a stock block a session kept uncompressed). ``depth`` counts the
    session turns behind a session entry (1 for a first turn). ``donor`` is the request
    whose KV it holds and ``source_ids`` the donor's blocks it was made from (the KV oracle,
    :mod:`obcache_vllm.eviction.oracle`, compares the three). ``chosen``: for a donor with an
    error target, the count it chose and its estimated error (reported again on adoption);
    ``error``: a session entry of an error target's, its estimated error against the
    uncompressed conversation (the next turn chooses within what is left of the target).
    """

    key: EntryKey
    entry_id: int
    block_ids: tuple[int, ...]
    hashes: tuple[bytes, ...]
    dead: int
    depth: int = 1
    kept_prompt: int | None = None
    donor: str | None = None
    source_ids: tuple[int, ...] = ()
    chosen: tuple[int, float] | None = None
    error: float | None = None
    # A session entry of a pipeline whose heads own their memory: its per-head layout.
    head_layout: tuple | None = None

    @property
    def tokens(self) -> int:
        return self.key.tokens


class EntryIndex:
    """The live entries of one engine, by key, oldest first (bounded)."""

    def __init__(self, capacity: int = 256) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[EntryKey, Entry] = OrderedDict()
        self._next_id = 1

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self):
        return iter(list(self._entries.values()))

    def new_id(self) -> int:
        entry_id, self._next_id = self._next_id, self._next_id + 1
        return entry_id

    def insert(self, entry: Entry) -> list[Entry]:
        """Add ``entry`` (replacing one with the same key); returns the entries it displaced
        (the same key's, and the oldest beyond the capacity) for the caller to release."""
        displaced = []
        old = self._entries.pop(entry.key, None)
        if old is not None:
            displaced.append(old)
        self._entries[entry.key] = entry
        while len(self._entries) > self.capacity:
            displaced.append(self._entries.popitem(last=False)[1])
        return displaced

    def get(self, key: EntryKey) -> Entry | None:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)  # recently used
        return entry

    def remove(self, entry: Entry) -> bool:
        if self._entries.get(entry.key) is entry:
            del self._entries[entry.key]
            return True
        return False

    def clear(self) -> list[Entry]:
        entries = list(self._entries.values())
        self._entries.clear()
        return entries

    def lengths(self, kind: str, options: tuple, at_most: int) -> list[int]:
        """Distinct token counts of ``kind`` entries with these options, longest first."""
        found = {
            e.key.tokens
            for e in self._entries.values()
            if e.key.kind == kind and e.key.options == options and e.key.tokens <= at_most
        }
        return sorted(found, reverse=True)

    def longest(
        self,
        kind: str,
        options: tuple,
        at_most: int,
        key_at: Callable[[int], EntryKey],
        valid: Callable[[Entry], bool],
    ) -> tuple[Entry | None, list[Entry]]:
        """The longest valid entry whose key ``key_at(tokens)`` gives, and the stale ones met.

        ``key_at(n)`` builds the key of a request's first ``n`` tokens; ``valid`` checks that
        every block of an entry is still its own (stale entries are removed and returned).
        """
        stale: list[Entry] = []
        for tokens in self.lengths(kind, options, at_most):
            entry = self._entries.get(key_at(tokens))
            if entry is None:
                continue
            if valid(entry):
                self._entries.move_to_end(entry.key)
                return entry, stale
            self.remove(entry)
            stale.append(entry)
        return None, stale


def release_order(entries: Iterable[Entry]) -> list[int]:
    """Block ids of ``entries`` (for the caller to drop their tags), each once."""
    seen: dict[int, None] = {}
    for entry in entries:
        for block_id in entry.block_ids:
            seen.setdefault(block_id, None)
    return list(seen)


VICTIM_ORDERS = ("reuse", "lru")


class HeldEntries:
    """Which entries the engine keeps out of vLLM's LRU, within a bounded number of blocks.

    An entry left as free, cached blocks is the first thing a busy pool reuses: with the pool
    at its limit, every other request's prefill takes free blocks from the LRU's head, so a
    compressed document is gone before its next question arrives (measured: 0 of 18 follow-ups
    found their entry). A *held* entry has one reference taken on each of its blocks, so the
    LRU cannot reuse them. The hold is bounded by ``limit`` blocks (a share of the pool), and
    the vLLM adapter lets entries go whenever a running request would otherwise be preempted
    or a waiting one could never be admitted (nothing else running). A released entry stays
    valid as ordinary free cached blocks until the LRU reuses one of them.

    The share adapts to the queue: entries may be held up to ``limit`` blocks while no request
    waits for room, but only ``base`` of them against a waiting request; above ``base`` they
    give way to a request waiting for blocks (:meth:`surplus_victim`), so held entries use room
    the pool has spare and never keep the queue waiting for more than ``base``.

    **Which entry goes first** (``victims``): ``"reuse"`` (the default) releases the entry whose
    next read is predicted furthest away, the rule that is optimal when the future is known
    (Belady's). Time is counted in *accesses* (:meth:`tick`: one per admitted request that
    looks entries up), an entry's next read is predicted from its *reuse distance* (accesses
    between two reads): its own, measured when it is adopted, or for a session turn's entry
    its parent's (a conversation keeps its cadence), or else a running average over the reads
    and misses seen (each measurement weighs :attr:`SMOOTHING`).
    An entry idle for longer than its predicted distance is *overdue* (late, or a chat that
    ended, a document no one asks about any more): overdue entries go first, longest idle
    first, then tentative ones, then the rest. ``"lru"`` releases the least recently used
    entry first. Chats are why the default is not LRU: clients cycle over their conversations,
    so the least recently used entry is the very one the next turn reads (docs/user_guide/
    sessions.md measures both). Holding a new entry past the limit releases others only when
    they rank further away than the new entry; otherwise the new one is not held.

    A *tentative* entry (a session the front end started on a guess: a prompt that may be a
    chat's first turn, see ``KvOptions.tentative``) is held as surplus whatever the share:
    it is the first to go for a waiting request or a new hold, until a request adopts it
    (:meth:`used`), which makes it an ordinary held entry. Unique-prompt traffic thus never
    keeps the queue waiting for entries no one reads. Plain Python: the adapter takes and
    drops the references.
    """

    # An entry idle for more than this times its predicted distance is overdue. Chosen on the
    # policy simulator (scripts/hold_sim.py, 3 seeds, chats of two shapes at 96-144 blocks):
    # 0.75-1.0 continued the most follow-ups, 2.0 fewer, never overdue far fewer.
    OVERDUE = 1.0
    SMOOTHING = 0.5  # weight of the newest measured reuse distance in the running estimates

    def __init__(self, limit: int, base: int | None = None, victims: str = "reuse") -> None:
        base = limit if base is None else base
        if limit < 0 or not 0 <= base <= limit:
            raise ValueError(f"need 0 <= base <= limit, got base {base}, limit {limit}")
        if victims not in VICTIM_ORDERS:
            raise ValueError(f"victims must be one of {VICTIM_ORDERS}, got {victims!r}")
        self.limit = limit
        self.base = base
        self.victims = victims
        self._held: OrderedDict[int, int] = OrderedDict()  # entry id -> blocks, oldest first
        self._tentative: OrderedDict[int, None] = OrderedDict()  # never adopted, oldest first
        self.blocks = 0
        self.clock = 0
        # Entry id -> clock at its hold or last read, for held entries and recently released
        # ones (a released entry wanted again measures its distance too: :meth:`missed`).
        self._last: OrderedDict[int, int] = OrderedDict()
        # Predicted reuse distance of each entry held or read lately (its own, or inherited
        # from the entry a session turn continued), bounded: most recent last.
        self._measured: OrderedDict[int, float] = OrderedDict()
        self.prior: float | None = None  # running mean of measured reuse distances
        self.wanted_after_release = 0  # released entries a request wanted again (counted)

    def __contains__(self, entry_id: int) -> bool:
        return entry_id in self._held

    def __len__(self) -> int:
        return len(self._held)

    def tick(self) -> None:
        """One access: a request that looks compressed entries up was admitted."""
        self.clock += 1

    def hold(self, entry_id: int, num_blocks: int, tentative: bool = False,
             like: int | None = None, replaces: int | None = None) -> list[int] | None:  # fmt: skip
        """Hold an entry of ``num_blocks``: the entry ids to release first to stay within the
        limit (in :meth:`release order <_ranked>`), or None if it is not held (larger than the
        limit, held already, or, with ``"reuse"``, ranking before every entry that would make
        room for it); with ``"lru"`` a new entry is always held, as earlier versions did.
        ``like`` is an entry whose measured reuse distance the new one is predicted to share
        (the session turn it continues); ``replaces`` a held entry the new one takes over (its
        parent turn): its blocks count as room, and it is dropped only if the new one is held
        (it is not among the ids returned)."""
        gap = self._measured.get(like) if like is not None else None
        if num_blocks > self.limit or entry_id in self._held:
            return None
        replaced = self._held.get(replaces, 0) if replaces is not None else 0
        released: list[int] = []
        room = self.limit - self.blocks + replaced
        if num_blocks > room:
            extra = (entry_id, gap, tentative) if self.victims == "reuse" else None
            for victim in self._ranked(extra=extra):
                if victim == replaces:
                    continue
                if victim == entry_id:
                    # the new entry is the one to go: keep the others, but remember it (its
                    # next read, or miss, is measured)
                    self._touch(entry_id)
                    if gap is not None:
                        self._remember_gap(entry_id, gap)
                    return None
                released.append(victim)
                room += self._held[victim]
                if room >= num_blocks:
                    break
        if replaced:
            self.drop(replaces)
        for victim in released:
            self.drop(victim)
        self._held[entry_id] = num_blocks
        self.blocks += num_blocks
        self._touch(entry_id)
        if gap is not None:
            self._remember_gap(entry_id, gap)
        if tentative:
            self._tentative[entry_id] = None
        return released

    def _remember_gap(self, entry_id: int, gap: float) -> None:
        self._measured[entry_id] = gap
        self._measured.move_to_end(entry_id)
        while len(self._measured) > self.KEEP:
            self._measured.popitem(last=False)

    KEEP = 4096  # released entries whose last read is remembered (and measured distances)

    def _touch(self, entry_id: int) -> None:
        self._last[entry_id] = self.clock
        self._last.move_to_end(entry_id)
        while len(self._last) > self.KEEP + len(self._held):
            oldest = next(iter(self._last))
            if oldest in self._held:  # a held entry idle that long: keep it, drop a ghost
                self._last.move_to_end(oldest)
                continue
            del self._last[oldest]

    def _measure(self, entry_id: int) -> None:
        """A read of ``entry_id`` (held or released) now: its reuse distance since its last
        hold or read updates its own prediction and the prior."""
        last = self._last.get(entry_id)
        if last is None:
            return
        distance = float(self.clock - last)
        a = self.SMOOTHING
        own = self._measured.get(entry_id)
        gap = distance if own is None else a * distance + (1 - a) * own
        self.prior = distance if self.prior is None else a * distance + (1 - a) * self.prior
        self._remember_gap(entry_id, gap)
        self._touch(entry_id)

    def used(self, entry_id: int) -> None:
        """An entry was adopted: its reuse distance is measured, it is no longer tentative,
        and it ranks as just read (an entry no longer held is measured too)."""
        self._measure(entry_id)
        if entry_id in self._held:
            self._held.move_to_end(entry_id)
            self._tentative.pop(entry_id, None)

    def used_again(self, entry_id: int) -> None:
        """An entry adopted again by the same request (admitted again after a preemption): no
        longer tentative, and last to go, but no new reuse distance."""
        if entry_id in self._held:
            self._held.move_to_end(entry_id)
            self._tentative.pop(entry_id, None)
            self._touch(entry_id)

    def missed(self, entry_id: int) -> None:
        """A request wanted an entry that is gone (released, then its blocks reused): its
        distance is measured as if it had been read, so the prediction learns from the reads
        it failed to serve."""
        if entry_id in self._last and entry_id not in self._held:
            self.wanted_after_release += 1
        self._measure(entry_id)

    def is_tentative(self, entry_id: int) -> bool:
        return entry_id in self._tentative

    def _forecast(self, gap: float | None, last: int) -> tuple[bool, float]:
        """(overdue, predicted accesses until the next read) of an entry held or read last at
        ``last`` with predicted reuse distance ``gap`` (larger: released sooner)."""
        gap = gap if gap is not None else self.prior
        idle = self.clock - last
        if gap is None:
            return False, float(idle)  # nothing measured yet: least recently used first
        if idle > self.OVERDUE * max(gap, 1.0):
            return True, float(idle)  # the longer idle, the less likely read again
        return False, gap - idle

    def _ranked(self, extra: tuple[int, float | None, bool] | None = None) -> list[int]:
        """Held entries (and ``extra`` = (id, predicted distance, tentative), an entry about
        to be held) in release order: by :attr:`victims`; for ``"reuse"``, overdue entries
        (longest idle first), then tentative ones (oldest first), then the rest, furthest
        predicted read first; for ``"lru"``, tentative ones, then least recently used."""
        tentative = list(self._tentative)
        rest = [e for e in self._held if e not in self._tentative]
        if extra is not None:
            (tentative if extra[2] else rest).append(extra[0])
        if self.victims == "lru":
            return tentative + rest  # _held is least recently used first; a new entry last

        def forecast(entry_id: int) -> tuple[bool, float]:
            if extra is not None and entry_id == extra[0]:
                return self._forecast(extra[1], self.clock)
            return self._forecast(self._measured.get(entry_id), self._last[entry_id])

        seen = {e: forecast(e) for e in tentative + rest}
        overdue = sorted((e for e in seen if seen[e][0]), key=lambda e: seen[e][1], reverse=True)
        # stable sorts: among equals the least recently used goes first
        return (
            overdue
            + [e for e in tentative if not seen[e][0]]
            + sorted((e for e in rest if not seen[e][0]), key=lambda e: seen[e][1], reverse=True)
        )

    NEW = -1  # the id :meth:`ahead_of_new` ranks a new entry by (entry ids are never negative)

    def ahead_of_new(self) -> list[int]:
        """Held entries that rank before a new, never-read, not tentative entry in release
        order (:meth:`_ranked`): the ones a new entry may take the room of when the pool has
        no free blocks to copy it into. With ``"reuse"``: the overdue ones, the tentative ones,
        then those whose next read is predicted further away than a new entry's (the prior);
        with ``"lru"``: all of them (a new entry is always held)."""
        order = self._ranked(extra=(self.NEW, None, False))
        return order[: order.index(self.NEW)]

    @property
    def surplus_blocks(self) -> int:
        """Blocks :meth:`surplus_victim` would give up: every tentative entry's, then the
        others' above ``base``."""
        tentative = sum(self._held[e] for e in self._tentative)
        return tentative + max(0, self.blocks - tentative - self.base)

    def oldest(self) -> int | None:
        """The next entry to release: the first in release order (:meth:`_ranked`)."""
        return next(iter(self._ranked()), None)

    def surplus_victim(self, keep: int | None = None) -> int | None:
        """The entry to release for a waiting request, other than ``keep`` (the entry that
        request adopts): the oldest tentative one, else the first by :attr:`victims` while more
        than ``base`` blocks are held; None when nothing held is surplus."""
        tentative = next((e for e in self._tentative if e != keep), None)
        if tentative is not None or self.blocks <= self.base:
            return tentative
        return next((e for e in self._ranked() if e != keep), None)

    def drop(self, entry_id: int) -> bool:
        num_blocks = self._held.pop(entry_id, None)
        if num_blocks is None:
            return False
        self._tentative.pop(entry_id, None)
        # its last read and distance stay (_last, _measured): it may be wanted again
        self.blocks -= num_blocks
        return True
