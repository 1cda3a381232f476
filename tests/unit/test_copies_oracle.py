"""A step's block copies and the KV oracle, on plain tensors (no vLLM)."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

from obcache_vllm.eviction.copies import copies_reading_unwritten, resolve_copy_chains
from obcache_vllm.eviction.ledger import CacheStart, RequestBlocks
from obcache_vllm.eviction.oracle import AdoptNote, EntryNote, KvOracle, VerifyNote, fingerprint
from obcache_vllm.options import KvOptions


class Copy(NamedTuple):  # the shape of vLLM's KVCacheBlockCopy
    src_block_id: int
    dst_block_id: int


def _run(blocks: torch.Tensor, copies) -> torch.Tensor:
    """vLLM's copy_kv_cache_blocks_inplace: one gather, then one scatter."""
    out = blocks.clone()
    if copies:
        src = torch.tensor([c[0] for c in copies])
        dst = torch.tensor([c[1] for c in copies])
        out[dst] = out[src]
    return out


def test_chains_read_the_first_source_and_equal_running_in_order():
    blocks = torch.arange(8.0).unsqueeze(1).repeat(1, 3)
    copies = [Copy(1, 4), Copy(4, 5), Copy(5, 6), Copy(2, 7)]
    resolved = resolve_copy_chains(copies)
    assert resolved == [Copy(1, 4), Copy(1, 5), Copy(1, 6), Copy(2, 7)]
    assert all(type(c) is Copy for c in resolved)
    in_order = blocks.clone()
    for src, dst in copies:
        in_order[dst] = in_order[src]
    assert torch.equal(_run(blocks, resolved), in_order)
    assert not torch.equal(_run(blocks, copies), in_order)  # the batch as vLLM runs it
    assert resolve_copy_chains([Copy(1, 2)]) == [Copy(1, 2)]


def test_copies_reading_unwritten_kv_are_found():
    copies = [Copy(1, 4), Copy(4, 5), Copy(9, 6), Copy(10, 7)]
    written = {9: 0, 10: 20}  # block -> first slot the forward pass writes in it
    needs = {7: 20}  # the copy into 7 needs only 20 slots (a partial last block)
    assert copies_reading_unwritten(copies, written, needs, 32) == [
        (4, 5, "chained"), (9, 6, "in_flight")
    ]  # fmt: skip
    assert copies_reading_unwritten(copies, written, {7: 21}, 32)[-1] == (10, 7, "in_flight")


def test_fingerprint_is_bitwise_per_head():
    keys = torch.randn(2, 5, 4)
    values = torch.randn(2, 5, 4)
    one = fingerprint(keys, values)
    assert len(one) == 2 and one == fingerprint(keys.clone(), values.clone())
    values[1, 3, 2] = torch.nextafter(values[1, 3, 2], torch.tensor(1e9))
    other = fingerprint(keys, values)
    assert other[0] == one[0] and other[1] != one[1]


class _Cache:
    """Layers x blocks x heads x slots x dim; the reader the runner gives the oracle."""

    def __init__(self, layers=2, blocks=12, heads=2, bs=4, dim=3) -> None:
        self.bs = bs
        self.kv = torch.randn(layers, 2, blocks, heads, bs, dim)

    def read(self, layer, block_ids, num_tokens):
        parts = [self.kv[layer, :, b] for b in block_ids]  # [2, H, bs, D] each
        both = torch.cat(parts, dim=2)[:, :, :num_tokens]
        return both[0], both[1]

    def copy(self, src, dst):
        self.kv[:, :, dst] = self.kv[:, :, src]


def test_oracle_passes_faithful_reuse_and_names_both_requests_otherwise():
    cache = _Cache()
    oracle = KvOracle(num_layers=2, block_size=4)
    # Donor "d" left tokens [1*4, 14) in its blocks [5, 6, 7] (dead = 1); its entry: [8, 9, 10].
    entry = EntryNote(entry_id=1, donor="d", tokens=14, dead=1, source_ids=(5, 6, 7),
                      block_ids=(8, 9, 10))  # fmt: skip
    oracle.before_copies(cache.read, VerifyNote(entries=(entry,)))
    for src, dst in zip(entry.source_ids, entry.block_ids, strict=True):
        cache.copy(src, dst)
    cache.kv[:, :, 7, :, 3] = 0.0  # past the entry's end in its last block: not compared
    adopter = {"a": [0, 8, 9, 10]}  # null block, then the entry's blocks
    note = VerifyNote(entries=(entry,), adopted=(("a", AdoptNote(1, "d", 14, 1)),))
    assert oracle.after_copies(cache.read, note, adopter, [], {}, {}) == []
    assert oracle.checks == 2
    cache.kv[1, 1, 9, 1, 0] += 1.0  # one value of layer 1, head 1 changes in the entry
    (copy_bad, adopt_bad) = oracle.after_copies(cache.read, note, adopter, [], {}, {})
    assert (copy_bad.reason, copy_bad.other_id) == ("entry_copy", "d")
    assert (adopt_bad.reason, adopt_bad.req_id, adopt_bad.other_id) == ("adopted", "a", "d")
    assert "layer 1, KV head 1" in adopt_bad.detail


def test_a_check_with_no_fingerprint_is_a_mismatch_not_a_pass():
    """An adopter of an entry the oracle never fingerprinted (or a copy whose donor it never
    read) used to be skipped: the check could not run and counted as agreement."""
    cache = _Cache()
    oracle = KvOracle(num_layers=2, block_size=4)
    entry = EntryNote(entry_id=7, donor="d", tokens=8, dead=0, source_ids=(5, 6),
                      block_ids=(8, 9))  # fmt: skip
    note = VerifyNote(entries=(entry,), adopted=(("a", AdoptNote(7, "d", 8, 0)),))
    bad = oracle.after_copies(cache.read, note, {"a": [8, 9]}, [], {}, {})
    assert [(m.reason, m.req_id) for m in bad] == [
        ("fingerprint_missing", "entry 7"), ("fingerprint_missing", "a")]  # fmt: skip
    # A session entry is its donor's own blocks: fingerprinted when made, compared when adopted
    session = EntryNote(entry_id=8, donor="s", tokens=8, dead=0, source_ids=(5, 6),
                        block_ids=(5, 6))  # fmt: skip
    oracle.before_copies(cache.read, VerifyNote(entries=(session,)))
    note = VerifyNote(entries=(session,), adopted=(("b", AdoptNote(8, "s", 8, 0)),))
    assert oracle.after_copies(cache.read, note, {"b": [5, 6]}, [], {}, {}) == []
    assert oracle.checks == 1


def test_oracle_reports_one_mismatch_per_pair_of_requests_for_copies():
    oracle = KvOracle(num_layers=1, block_size=4)
    copies = [Copy(1, 4), Copy(2, 5), Copy(3, 6)]
    written = {1: ("writer", 0), 2: ("writer", 0)}
    owners = {4: "reader", 5: "reader", 6: "reader", 1: "writer", 2: "writer", 3: "other"}
    (bad,) = oracle.after_copies(None, VerifyNote(), {}, copies, written, owners)
    assert (bad.reason, bad.req_id, bad.other_id) == ("copy_in_flight", "reader", "writer")
    assert bad.detail.startswith("2 block copies")


def test_a_retried_lookup_starts_from_nothing():
    blocks = RequestBlocks(KvOptions(budget=64), prompt_len=300, block_size=32)
    blocks.adopt(CacheStart("compress_at", 200, dead=4, kept_prompt=72, entry_id=3, donor="d"))
    assert blocks.dead == 4 and blocks.kept_prompt is not None
    blocks.unadopt()
    assert (blocks.dead, blocks.past_point, blocks.kept_prompt, blocks.start) == (0, False, None,
                                                                                   None)
    blocks.unadopt()  # nothing adopted: nothing to forget
    assert blocks.start is None


@pytest.mark.parametrize("n", [0, 1])
def test_resolve_leaves_short_batches_alone(n):
    copies = [Copy(1, 2)][:n]
    assert resolve_copy_chains(copies) == copies
