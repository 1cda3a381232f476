"""The compressed-entry index and the held share (obcache_vllm.eviction.entries), on plain
objects; the vLLM side is tests/engine/test_prefix_cache.py."""

from __future__ import annotations

import pytest

from obcache_vllm.config import ConfigError, entry_pool_share, entry_pool_share_max
from obcache_vllm.eviction.entries import Entry, EntryIndex, EntryKey, HeldEntries, is_tag, tag


def _entry(index: EntryIndex, tokens: int, options=("tova",), blocks=2) -> Entry:
    key = EntryKey("compress_at", tokens, b"h%d" % tokens, (), options)
    return Entry(key, index.new_id(), tuple(range(blocks)), (b"x",) * blocks, dead=0)


def test_index_is_bounded_oldest_first_and_a_key_is_replaced():
    index = EntryIndex(capacity=2)
    a, b = _entry(index, 10), _entry(index, 20)
    assert index.insert(a) == [] and index.insert(b) == []
    index.get(a.key)  # a is now the most recently used
    c = _entry(index, 30)
    assert index.insert(c) == [b]
    a2 = Entry(a.key, index.new_id(), (7,), (b"y",), dead=1)
    assert index.insert(a2) == [a] and len(index) == 2


def test_longest_valid_entry_wins_and_stale_ones_are_removed():
    index = EntryIndex()
    short, long = _entry(index, 10), _entry(index, 40)
    other = _entry(index, 50, options=("snapkv",))
    for e in (short, long, other):
        index.insert(e)
    keys = {e.key.tokens: e.key for e in (short, long)}
    found, stale = index.longest("compress_at", ("tova",), 45, keys.get, lambda e: e is not long)
    assert found is short and stale == [long] and long not in index
    assert index.longest("compress_at", ("tova",), 9, keys.get, lambda e: True) == (None, [])


def test_tags_never_look_like_token_hashes():
    assert is_tag(tag(3, 1)) and tag(3, 1) != tag(1, 3) and not is_tag(b"\0" * 32)


def test_held_share_releases_least_recently_used_first():
    held = HeldEntries(limit=10)
    assert held.hold(1, 4) == [] and held.hold(2, 4) == []
    held.used(1)  # 2 is now the least recently used
    assert held.hold(3, 4) == [2] and held.blocks == 8
    assert held.hold(4, 11) is None  # larger than the whole share: not held
    assert held.hold(3, 4) is None  # already held
    assert held.oldest() == 1 and held.drop(1) and not held.drop(1)
    assert held.blocks == 4 and 3 in held and len(held) == 1
    assert HeldEntries(0).hold(1, 1) is None


def test_tentative_holds_give_way_first_until_adopted():
    held = HeldEntries(limit=12, base=12)
    assert held.hold(1, 4) == [] and held.hold(2, 4, tentative=True) == []
    assert held.hold(3, 4, tentative=True) == []
    # within the base share, yet a waiting request may take the tentative ones, oldest first
    assert held.surplus_blocks == 8
    assert held.surplus_victim() == 2 and held.surplus_victim(keep=2) == 3
    assert held.oldest() == 2  # and a new hold past the limit releases them first
    held.used(2)  # adopted: an ordinary held entry now, the most recently used
    assert not held.is_tentative(2) and held.surplus_victim() == 3
    assert held.hold(4, 4) == [3] and held.surplus_blocks == 0
    assert held.surplus_victim() is None and held.oldest() == 1
    held.drop(4)
    assert held.hold(5, 4, tentative=True) == [] and held.drop(5)
    assert not held.is_tentative(5) and held.surplus_blocks == 0


def test_entry_pool_share_from_the_environment():
    assert entry_pool_share({}) == 0.25
    assert entry_pool_share({"OBCACHE_ENTRY_POOL_SHARE": "0"}) == 0.0
    assert entry_pool_share({"OBCACHE_ENTRY_POOL_SHARE": "0.5"}) == 0.5
    for bad in ("1.5", "-0.1", "nan", "half"):
        with pytest.raises(ConfigError, match="OBCACHE_ENTRY_POOL_SHARE"):
            entry_pool_share({"OBCACHE_ENTRY_POOL_SHARE": bad})


def test_entry_pool_share_max_from_the_environment():
    assert entry_pool_share_max({}) == 0.75  # unset: three quarters while no request waits
    assert entry_pool_share_max({"OBCACHE_ENTRY_POOL_SHARE_MAX": "0.5"}) == 0.5
    # the release before: the base share only
    assert entry_pool_share_max({"OBCACHE_ENTRY_POOL_SHARE_MAX": "0.25"}) == 0.25
    # never below the base share; holding off turns the surplus off too
    assert entry_pool_share_max({"OBCACHE_ENTRY_POOL_SHARE": "0.9"}) == 0.9
    assert entry_pool_share_max({"OBCACHE_ENTRY_POOL_SHARE": "0"}) == 0.0
    with pytest.raises(ConfigError, match="OBCACHE_ENTRY_POOL_SHARE_MAX"):
        entry_pool_share_max({"OBCACHE_ENTRY_POOL_SHARE_MAX": "2"})


def test_holds_above_the_base_share_give_way_to_a_waiting_request():
    held = HeldEntries(limit=12, base=4)
    assert held.hold(1, 4) == [] and held.surplus_victim() is None  # within the base share
    assert held.hold(2, 4) == [] and held.hold(3, 4) == []  # up to the limit while none waits
    assert held.surplus_victim() == 1  # least recently used first
    assert held.surplus_victim(keep=1) == 2  # never the entry the waiting request adopts
    held.drop(1)
    held.drop(2)
    assert held.blocks == 4 and held.surplus_victim() is None  # back within the base share
    with pytest.raises(ValueError):
        HeldEntries(limit=4, base=5)


def _round_robin(victims: str, rounds: int = 6) -> int:
    """Reads that found their entry: 4 conversations taken in turn, each turn reading its
    conversation's last entry and leaving a new one of 4 blocks, in room for 3 of them."""
    held = HeldEntries(limit=12, victims=victims)
    current: dict[int, int] = {}  # conversation -> its newest entry
    found = 0
    next_id = 1
    for _ in range(rounds):
        for conv in range(4):
            held.tick()
            parent = current.get(conv)
            if parent is not None and parent in held:
                held.used(parent)
                found += 1
            elif parent is not None:
                held.missed(parent)  # as the adapter does on finding it stale
            if parent is not None:
                held.drop(parent)  # the turn's entry takes its parent's blocks over
            held.hold(next_id, 4, like=parent)
            current[conv] = next_id
            next_id += 1
    return found


def test_reuse_order_keeps_the_entries_a_round_robin_reads_next():
    # LRU releases exactly the entry the next turn reads: after the first round, no turn
    # finds its entry. Ranking by predicted reuse keeps three of four conversations going.
    assert _round_robin("lru") == 0
    assert _round_robin("reuse") >= 14  # of 20 follow-ups; 3 in 4 is the room's bound


def test_reuse_order_releases_overdue_entries_first():
    held = HeldEntries(limit=8)
    assert held.hold(1, 4) == [] and held.hold(2, 4) == []
    held.tick()
    held.used(2)  # read after one access: a short predicted distance for 2 and the prior
    for _ in range(6):
        held.tick()
    # 1 was never read and has idled far past the prior: it goes before 2, and before a new
    # entry whose next read is predicted at the prior's distance
    assert held.oldest() == 1 and held.hold(3, 4) == [1]
    # an entry predicted to be read later than every held one is not held, releasing nothing
    held = HeldEntries(limit=4)
    assert held.hold(9, 4) == []
    for _ in range(5):
        held.tick()
    held.used(9)  # a conversation read after 5 accesses
    held.drop(9)
    assert held.hold(1, 4) == []
    held.tick()
    held.used(1)  # read after 1 access: read again soon
    assert held.hold(2, 4, like=9) is None and 2 not in held and 1 in held  # 9's cadence
    with pytest.raises(ValueError):
        HeldEntries(4, victims="mru")


def test_a_new_entry_may_take_the_room_of_the_entries_that_rank_before_it():
    """What an entry copy short of free blocks may release (the adapter's ``_make_room``): the
    entries ahead of a new one in release order, not the ones predicted to be read sooner."""
    held = HeldEntries(limit=16)
    for entry_id in (1, 2, 3):
        assert held.hold(entry_id, 4) == []
    # nothing measured yet: least recently used first, a new entry last
    assert held.ahead_of_new() == [1, 2, 3]
    held.tick()
    held.used(3)  # read after 1 access
    for _ in range(5):
        held.tick()
    held.used(2)  # read after 6: 2's next read is predicted 6 accesses away
    held.used(3)  # read again after 5: predicted at 3 (its reads), the prior at 4.25 (all)
    # 1 was never read and idled past the prior (overdue): first; 2's next read is further
    # away than a new entry's (the prior), 3's nearer: it stays
    assert held.ahead_of_new() == [1, 2]
    assert HeldEntries(limit=4).ahead_of_new() == []
    lru = HeldEntries(limit=8, victims="lru")
    assert lru.hold(1, 4) == [] and lru.hold(2, 4) == []
    lru.used(2)
    assert lru.ahead_of_new() == [1, 2]  # "lru" holds every new entry


def test_entry_victims_from_the_environment():
    from obcache_vllm.config import entry_victims

    assert entry_victims({}) == "reuse"
    assert entry_victims({"OBCACHE_ENTRY_VICTIMS": "lru"}) == "lru"
    with pytest.raises(ConfigError, match="OBCACHE_ENTRY_VICTIMS"):
        entry_victims({"OBCACHE_ENTRY_VICTIMS": "fifo"})


def test_a_turn_takes_its_parents_hold_over_or_leaves_it():
    held = HeldEntries(limit=10)
    assert held.hold(1, 6) == []
    # the parent's blocks count as room: no other entry goes, and the parent is dropped
    assert held.hold(2, 8, like=1, replaces=1) == [] and 1 not in held and held.blocks == 8
    # a new entry that ranks first is not held, and the entry it would replace keeps its hold
    held = HeldEntries(limit=8)
    assert held.hold(9, 8) == []
    for _ in range(5):
        held.tick()
    held.used(9)  # a slow conversation
    held.drop(9)
    assert held.hold(1, 4) == [] and held.hold(3, 4) == []
    held.tick()
    held.used(1)
    held.used(3)
    assert held.hold(2, 8, like=9, replaces=3) is None and 3 in held and held.blocks == 8
    # ...and is remembered: a later read of it measures its distance
    held.tick()
    held.used(2)
    assert held._measured[2] > 0


def test_lru_holds_every_new_entry_as_earlier_versions_did():
    held = HeldEntries(limit=10, victims="lru")
    assert held.hold(1, 10) == []
    assert held.hold(2, 5, tentative=True) == [1] and 2 in held  # the new one is held
    assert held.hold(3, 6) == [2] and held.blocks == 6
