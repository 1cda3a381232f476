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
    :mod:`obcache_vllm.eviction.oracle`, compares the three).
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


class HeldEntries:
    """Which entries the engine keeps out of vLLM's LRU, within a bounded number of blocks.

    An entry left as free, cached blocks is the first thing a busy pool reuses: with the pool
    at its limit, every other request's prefill takes free blocks from the LRU's head, so a
    compressed document is gone before its next question arrives (measured: 0 of 18 follow-ups
    found their entry). A *held* entry has one reference taken on each of its blocks, so the
    LRU cannot reuse them. The hold is bounded by ``limit`` blocks (a share of the pool);
    holding a new entry past it lets the least recently used ones go first, and the vLLM
    adapter lets them go, oldest first, whenever a running request would otherwise be
    preempted or a waiting one could never be admitted (nothing else running). A released
    entry stays valid as ordinary free cached blocks until the LRU reuses one of them.

    The share adapts to the queue: entries may be held up to ``limit`` blocks while no request
    waits for room, but only ``base`` of them against a waiting request; above ``base`` the
    least recently used give way to a request waiting for blocks (:meth:`surplus_victim`),
    so held entries use room the pool has spare and never keep the queue waiting for more
    than ``base``.

    A *tentative* entry (a session the front end started on a guess: a prompt that may be a
    chat's first turn, see ``KvOptions.tentative``) is held as surplus whatever the share:
    it is the first to go for a waiting request or a new hold, until a request adopts it
    (:meth:`used`), which makes it an ordinary held entry. Unique-prompt traffic thus never
    keeps the queue waiting for entries no one reads. Plain Python: the adapter takes and
    drops the references.
    """

    def __init__(self, limit: int, base: int | None = None) -> None:
        base = limit if base is None else base
        if limit < 0 or not 0 <= base <= limit:
            raise ValueError(f"need 0 <= base <= limit, got base {base}, limit {limit}")
        self.limit = limit
        self.base = base
        self._held: OrderedDict[int, int] = OrderedDict()  # entry id -> blocks, oldest first
        self._tentative: OrderedDict[int, None] = OrderedDict()  # never adopted, oldest first
        self.blocks = 0

    def __contains__(self, entry_id: int) -> bool:
        return entry_id in self._held

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, entry_id: int, num_blocks: int, tentative: bool = False) -> list[int] | None:
        """Hold an entry of ``num_blocks``: the entry ids to release first to stay within the
        limit (tentative ones, then the least recently used), or None if it cannot be held."""
        if num_blocks > self.limit or entry_id in self._held:
            return None
        released = []
        while self.blocks + num_blocks > self.limit:
            released.append(self.oldest())
            self.drop(released[-1])
        self._held[entry_id] = num_blocks
        self.blocks += num_blocks
        if tentative:
            self._tentative[entry_id] = None
        return released

    def used(self, entry_id: int) -> None:
        """An entry was adopted: it is the last to be released, and no longer tentative."""
        if entry_id in self._held:
            self._held.move_to_end(entry_id)
            self._tentative.pop(entry_id, None)

    def is_tentative(self, entry_id: int) -> bool:
        return entry_id in self._tentative

    @property
    def surplus_blocks(self) -> int:
        """Blocks :meth:`surplus_victim` would give up: every tentative entry's, then the
        others' above ``base``."""
        tentative = sum(self._held[e] for e in self._tentative)
        return tentative + max(0, self.blocks - tentative - self.base)

    def oldest(self) -> int | None:
        """The next entry to release: the oldest tentative one, else the least recently used."""
        tentative = next(iter(self._tentative), None)
        return tentative if tentative is not None else next(iter(self._held), None)

    def surplus_victim(self, keep: int | None = None) -> int | None:
        """The entry to release for a waiting request, other than ``keep`` (the entry that
        request adopts): the oldest tentative one, else the least recently used while more
        than ``base`` blocks are held; None when nothing held is surplus."""
        tentative = next((e for e in self._tentative if e != keep), None)
        if tentative is not None or self.blocks <= self.base:
            return tentative
        return next((e for e in self._held if e != keep), None)

    def drop(self, entry_id: int) -> bool:
        num_blocks = self._held.pop(entry_id, None)
        if num_blocks is None:
            return False
        self._tentative.pop(entry_id, None)
        self.blocks -= num_blocks
        return True
