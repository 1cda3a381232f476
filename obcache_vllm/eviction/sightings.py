"""Prompt prefixes seen recently (front-end process): where ``kv_compress_at: "auto"`` compresses.

A budget over a whole prompt makes each request compress its own copy of a document that
stock vLLM would share from its prefix cache. ``kv_compress_at: "auto"`` (the server policy's
default, see :mod:`obcache_vllm.config`) compresses instead at the longest prefix the prompt
shares with a recent budgeted prompt, so that prefix is compressed once, query-agnostic, and
every later request with it adopts the compressed entry (:mod:`obcache_vllm.eviction.entries`).

The decision is the front end's, before the request reaches the engine, so the scheduler and
the worker receive an ordinary ``kv_compress_at = k`` and nothing downstream changes. It is
made from prompts only (this index), never from the engine's cache state:

* a prompt's full blocks of ``block_size`` tokens are hashed as a chain (each block's hash
  covers every token before it, as vLLM's prefix-cache hashes do), seeded by the cache salt
  and the LoRA adapter, so prompts that could never share KV never match;
* the longest chain hash already in the index gives the shared length ``s`` (whole blocks);
  the prompt's own hashes, and a hash of the whole prompt, are then recorded (least recently
  seen dropped past ``capacity``);
* a prompt that *continues* a recorded one (all of that prompt's tokens are a strict prefix of
  it, as a chat's next turn resends the last turn's prompt with the answer and a new message)
  is served as ``kv_session``: it continues the compressed cache the last turn left and
  leaves its own for the next;
* else the request compresses at ``s`` when ``s`` covers at least :data:`MIN_SHARE` of its
  prompt (so at most half of it is left uncompressed) and is shorter than the prompt (questions
  over one document: the second compresses the document, the later ones adopt it);
* a prompt that *repeats* a recorded one (the same tokens, a retry or a re-sent context)
  compresses where that one was compressed (:meth:`PrefixSightings.remember`) and adopts the
  entry it left: the same cache, the same answer;
* else over its whole prompt but its last token, query-aware, and as a *tentative* session:
  it may be a chat's first turn, so its final cache is left for a next turn, held only while
  no request needs the blocks (``KvOptions.tentative``,
  :class:`~obcache_vllm.eviction.entries.HeldEntries`); the compressed prompt it leaves is
  also found by a repeat of it.

A hash collision can only choose a compress point; the entries themselves are keyed by
vLLM's hashes and checked token by token. Plain Python: no vLLM, no torch.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

# The smallest share of a prompt a shared prefix must cover to become its compress point: a
# short common head (a system prompt) must not leave the rest of a long prompt uncompressed.
MIN_SHARE = 0.5
DEFAULT_CAPACITY = 1 << 16  # block hashes (a million tokens at 16 per block)


@dataclass(frozen=True)
class Sighting:
    """What the index knew of a prompt: the tokens (whole blocks) it shares with a recorded
    prompt, and whether a recorded prompt, all of its tokens, is a strict prefix of it (the
    prompt continues that one, as a chat's next turn resends the last turn's prompt)."""

    shared: int
    continues: bool
    repeats: bool = False  # this very prompt (all its tokens, same seed) was recorded before
    point: int | None = None  # the compress point recorded for it then (:meth:`remember`)


class PrefixSightings:
    """Chain hashes of recently seen prompt blocks (see the module docstring)."""

    def __init__(self, block_size: int, capacity: int = DEFAULT_CAPACITY) -> None:
        if block_size < 1 or capacity < 1:
            raise ValueError(f"block_size {block_size} and capacity {capacity} must be >= 1")
        self.block_size = block_size
        self.capacity = capacity
        self._seen: OrderedDict[int, None] = OrderedDict()
        # Whole recorded prompts: (hash of the chain before the tail, tail tokens) hashed, with
        # the point each was compressed at; for each such chain hash the tail lengths after it.
        self._ends: OrderedDict[int, int | None] = OrderedDict()  # -> point (remember)
        self._tails: OrderedDict[int, set[int]] = OrderedDict()
        self._lock = threading.Lock()  # the API server admits from one event loop; LLM too

    def _root(self, seed: Hashable) -> int:
        return hash(("obcache-vllm/sightings", seed))

    def chain(self, token_ids: Sequence[int], seed: Hashable = None) -> list[int]:
        """One hash per full block of ``token_ids``, each covering every token before it."""
        bs, out = self.block_size, []
        h = self._root(seed)
        for start in range(0, len(token_ids) - bs + 1, bs):
            h = hash((h, tuple(token_ids[start : start + bs])))
            out.append(h)
        return out

    def observe(self, token_ids: Sequence[int], seed: Hashable = None) -> Sighting:
        """What was seen of ``token_ids`` before (a :class:`Sighting`); then record this
        prompt as seen."""
        bs = self.block_size
        hashes = self.chain(token_ids, seed)
        bases = [self._root(seed), *hashes]  # bases[k]: the chain of the first k blocks
        with self._lock:
            shared = 0
            for i in range(len(hashes) - 1, -1, -1):
                if hashes[i] in self._seen:
                    shared = (i + 1) * bs
                    break
            # A recorded prompt of k whole blocks and a t-token tail is a strict prefix of
            # this one when its k blocks match (k <= shared blocks) and so do the next t tokens.
            continues = any(
                k * bs + t < len(token_ids)
                and hash((bases[k], tuple(token_ids[k * bs : k * bs + t]))) in self._ends
                for k in range(shared // bs, -1, -1)
                for t in self._tails.get(bases[k], ())
            )
            end = self._end(token_ids, bases[-1])
            repeats = end in self._ends
            point = self._ends.get(end)
            for h in hashes:
                self._seen[h] = None
                self._seen.move_to_end(h)
            self._ends[end] = point
            self._ends.move_to_end(end)
            base, tail = bases[-1], len(token_ids) - len(hashes) * bs
            self._tails.setdefault(base, set()).add(tail)
            self._tails.move_to_end(base)
            for index in (self._seen, self._ends, self._tails):
                while len(index) > self.capacity:
                    index.popitem(last=False)
        return Sighting(shared, continues, repeats, point)

    def _end(self, token_ids: Sequence[int], base: int) -> int:
        """The key of a whole prompt: its full blocks' chain hash ``base`` and its tail."""
        full = len(token_ids) // self.block_size * self.block_size
        return hash((base, tuple(token_ids[full:])))

    def remember(self, token_ids: Sequence[int], seed: Hashable, point: int | None) -> None:
        """Record where a prompt just observed was compressed (None: no point), so that the
        same prompt sent again compresses there too and adopts the entry it left."""
        hashes = self.chain(token_ids, seed)
        end = self._end(token_ids, hashes[-1] if hashes else self._root(seed))
        with self._lock:
            if end in self._ends:
                self._ends[end] = point

    def __len__(self) -> int:
        return len(self._seen)


def auto_point(shared: int, num_prompt_tokens: int, earlier: int | None = None) -> int | None:
    """The compress point of a ``kv_compress_at: "auto"`` request whose first ``shared``
    tokens were seen before (None: compress the whole prompt). A prompt seen before, all of
    it, compresses where it was compressed then (``earlier``, :meth:`PrefixSightings.
    remember`), so that it adopts the entry it left and is served exactly as it was then."""
    if earlier is not None and 0 < earlier < num_prompt_tokens:
        return earlier
    shared = min(shared, num_prompt_tokens - 1)
    if shared <= 0 or shared < MIN_SHARE * num_prompt_tokens:
        return None
    return shared
