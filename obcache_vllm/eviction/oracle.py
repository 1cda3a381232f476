"""The KV oracle: every reuse of KV between requests checked bit for bit (plain torch).

A verification mode (``OBCACHE_VLLM_VERIFY=1``; off in production, on in the test suite and
the stress runs). Reuse exact by construction can still go wrong in the engine, when requests
run together; the oracle reads the cache tensors back and compares:

* **what a donor left**: when a compressed entry is made, the donor's live KV over the
  entry's tokens (logical slots ``[dead*bs, tokens)``, per layer and KV head) is fingerprinted
  before the step that copies it runs;
* **the entry**: a ``kv_compress_at`` entry is a copy; once the step's copies have run, its
  blocks must hold exactly what the donor left (``reason="entry_copy"``);
* **every adopter**: a request that starts from an entry must start from exactly what the
  donor left, read through its own block table after the copies of its first step
  (``reason="adopted"``);
* **every copy**: no copy of a step may read a block whose KV is not there yet: the
  destination of another copy in the same batch (``"copy_chained"``), or a block the step's
  forward pass writes (``"copy_in_flight"``); see :mod:`obcache_vllm.eviction.copies`.

Every entry is fingerprinted when it is made, a session's as a copy's (its blocks are the
donor's own: they are compared when adopted). A check with no fingerprint to compare with
(``"fingerprint_missing"``) is a mismatch, never a pass: an oracle that cannot look has not
seen the KV agree.

A mismatch is a :class:`KvMismatch` naming both requests; the scheduler counts it as a fault
(stage ``verify``, ``vllm:obcache_eviction_failures_total``) and logs it. The oracle does not
stop the request: it is a witness, not a repair.

Cost: one gather of the entry's tokens per layer for each entry and each adoption, and a set
of the step's written block ids: off by default.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from obcache_vllm import settings
from obcache_vllm.eviction.copies import copies_reading_unwritten

VERIFY_ENV = settings.VERIFY
_KEPT = 1024  # fingerprints of entries kept for later adopters (oldest dropped first)

# layer -> (keys [Hkv, N, D], values [Hkv, N, D]) of a run of blocks: what a backend view reads.
Reader = Callable[[int, Sequence[int], int], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class EntryNote:
    """A compressed entry made since the last step (scheduler -> worker)."""

    entry_id: int
    donor: str
    tokens: int
    dead: int
    source_ids: tuple[int, ...]  # the donor's blocks [dead, cdiv(tokens, bs))
    block_ids: tuple[int, ...]  # the entry's blocks (the same as source_ids for a session)


@dataclass(frozen=True)
class AdoptNote:
    """A request admitted this step that starts from an entry (scheduler -> worker)."""

    entry_id: int
    donor: str
    tokens: int
    dead: int


@dataclass(frozen=True)
class VerifyNote:
    """What the worker checks in one step (``SchedulerOutput.obcache_verify``)."""

    entries: tuple[EntryNote, ...] = ()
    adopted: tuple[tuple[str, AdoptNote], ...] = ()


@dataclass(frozen=True)
class KvMismatch:
    """One failed check: ``req_id`` read KV that ``other_id`` left (or writes)."""

    reason: str
    req_id: str
    other_id: str
    detail: str


def fingerprint(keys: torch.Tensor, values: torch.Tensor) -> tuple[bytes, ...]:
    """One digest per KV head of ``keys``/``values`` [Hkv, N, D] (bitwise: any dtype)."""
    digests = []
    for head in range(keys.shape[0]):
        h = hashlib.blake2b(digest_size=16)
        for part in (keys[head], values[head]):
            h.update(part.contiguous().view(torch.uint8).numpy().tobytes())
        digests.append(h.digest())
    return tuple(digests)


class KvOracle:
    """The worker's half of the oracle (one per model runner)."""

    def __init__(self, num_layers: int, block_size: int) -> None:
        self.num_layers = num_layers
        self.block_size = block_size
        self._left: OrderedDict[int, tuple[str, list[tuple[bytes, ...]]]] = OrderedDict()
        self.checks = 0  # comparisons made (tests assert the oracle looked at something)

    def region(self, read: Reader, block_ids: Sequence[int], dead: int, tokens: int):
        """Digests per layer of logical slots ``[dead*bs, tokens)`` of a block list that
        starts at block ``dead`` (``block_ids[0]`` holds slot ``dead*bs``)."""
        num = tokens - dead * self.block_size
        nb = -(-num // self.block_size)
        blocks = list(block_ids[:nb])
        return [fingerprint(*read(layer, blocks, num)) for layer in range(self.num_layers)]

    def before_copies(self, read: Reader, note: VerifyNote) -> None:
        """Fingerprint what each new entry's donor left (the step's copies have not run)."""
        for entry in note.entries:
            self._left[entry.entry_id] = (
                entry.donor,
                self.region(read, entry.source_ids, entry.dead, entry.tokens),
            )
            while len(self._left) > _KEPT:
                self._left.popitem(last=False)

    def after_copies(
        self,
        read: Reader,
        note: VerifyNote,
        tables: dict[str, Sequence[int]],
        copies: Sequence[Sequence[int]],
        written: dict[int, str],
        owners: dict[int, str],
    ) -> list[KvMismatch]:
        """The checks once the step's copies have run, before its forward pass.

        ``tables``: the block list of each adopter; ``written``: block id -> (the request the
        forward pass writes it for, the first slot it writes); ``owners``: block id -> a
        request that holds it."""
        bs = self.block_size
        # A copy into an entry or an adopter's start needs only the slots below the entry's
        # end (the donor may be writing the rest of its last block in this step).
        needs, owners = {}, dict(owners)
        for entry in note.entries:
            for i, block in enumerate(entry.block_ids):
                needs[block] = min(bs, entry.tokens - (entry.dead + i) * bs)
                owners.setdefault(block, f"entry {entry.entry_id} of {entry.donor}")
        for req_id, adopt in note.adopted:
            table = tables.get(req_id, ())
            for i in range(adopt.dead, min(len(table), -(-adopt.tokens // bs))):
                needs[table[i]] = min(bs, adopt.tokens - i * bs)
        first_slot = {block: slot for block, (_, slot) in written.items()}
        bad: list[KvMismatch] = []
        wrong: dict[tuple[str, str, str], list[str]] = {}  # one mismatch per pair of requests
        for src, dst, why in copies_reading_unwritten(copies, first_slot, needs, bs):
            writer = written[src][0] if src in written else owners.get(src, "?")
            wrong.setdefault((why, owners.get(dst, "?"), writer), []).append(f"{src}->{dst}")
        for (why, reader, writer), pairs in wrong.items():
            bad.append(KvMismatch(f"copy_{why}", reader, writer,
                                  f"{len(pairs)} block copies read blocks whose KV is not "
                                  f"written yet ({', '.join(pairs[:4])})"))  # fmt: skip
        for entry in note.entries:
            if entry.block_ids == entry.source_ids:  # a session entry: the donor's own blocks
                continue
            left = self._left.get(entry.entry_id)
            if left is None:  # nothing to compare with is a failed check, never a pass
                bad.append(_missing(f"entry {entry.entry_id}", entry.donor, entry.entry_id))
                continue
            self.checks += 1
            got = self.region(read, entry.block_ids, entry.dead, entry.tokens)
            where = _first_difference(left[1], got)
            if where is not None:
                bad.append(KvMismatch("entry_copy", f"entry {entry.entry_id}", entry.donor,
                                      f"entry differs from its donor at {where}"))  # fmt: skip
        for req_id, adopt in note.adopted:
            left = self._left.get(adopt.entry_id)
            table = tables.get(req_id)
            if left is None:
                bad.append(_missing(req_id, adopt.donor, adopt.entry_id))
                continue
            self._left.move_to_end(adopt.entry_id)  # kept while it is adopted
            if table is None:
                bad.append(KvMismatch("adopted", req_id, adopt.donor,
                                      "the adopter has no block table in the worker"))  # fmt: skip
                continue
            self.checks += 1
            got = self.region(read, table[adopt.dead :], adopt.dead, adopt.tokens)
            where = _first_difference(left[1], got)
            if where is not None:
                bad.append(KvMismatch("adopted", req_id, adopt.donor,
                                      f"starts from KV that differs from what its donor left "
                                      f"(entry {adopt.entry_id}) at {where}"))  # fmt: skip
        return bad


def _missing(req_id: str, donor: str, entry_id: int) -> KvMismatch:
    return KvMismatch("fingerprint_missing", req_id, donor,
                      f"no fingerprint of what the donor left in entry {entry_id}: the check "
                      "could not run")  # fmt: skip


def _first_difference(left, got) -> str | None:
    for layer, (a, b) in enumerate(zip(left, got, strict=True)):
        for head, (x, y) in enumerate(zip(a, b, strict=True)):
            if x != y:
                return f"layer {layer}, KV head {head}"
    return None
