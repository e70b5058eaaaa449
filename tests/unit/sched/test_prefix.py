"""The prefix cache's bookkeeping: chained keys, holders, idle blocks and eviction."""

from __future__ import annotations

import pytest

from kvasir.sched.blocks import BlockAllocator
from kvasir.sched.prefix import PrefixCache, block_keys

BLOCK = 4


def cache(blocks: int = 8, enabled: bool = True) -> PrefixCache:
    return PrefixCache(BlockAllocator(blocks), BLOCK, enabled)


def test_keys_chain_so_a_block_is_known_by_everything_before_it():
    a = block_keys([1, 2, 3, 4, 5, 6, 7, 8], BLOCK, 2)
    b = block_keys([9, 2, 3, 4, 5, 6, 7, 8], BLOCK, 2)
    assert len(a) == 2 and len(set(a)) == 2
    assert a[0] != b[0] and a[1] != b[1]  # same second block, different first: different keys
    assert block_keys([5, 6, 7, 8], BLOCK, 1, parent=a[0]) == a[1:]
    assert block_keys([1, 2, 3, 4, 5], BLOCK, 1) == a[:1]
    with pytest.raises(ValueError, match="not full"):
        block_keys([1, 2, 3, 4, 5], BLOCK, 2)


def test_a_registered_prefix_is_found_up_to_its_first_unknown_block():
    c = cache()
    keys = block_keys(list(range(12)), BLOCK, 3)
    held = c.take([], 3)
    assert held is not None
    c.register(held[0], keys[0])
    c.register(held[1], keys[1])
    assert c.lookup(keys) == held[:2]
    assert c.lookup(block_keys([99] + list(range(1, 12)), BLOCK, 3)) == []
    assert c.cached_blocks == 2


def test_blocks_held_by_several_requests_stay_until_the_last_lets_go():
    c = cache(blocks=4)
    keys = block_keys(list(range(8)), BLOCK, 2)
    first = c.take([], 3)
    assert first is not None
    for block, key in zip(first, keys):
        c.register(block, key)
    second = c.take(c.lookup(keys), 1)
    assert second is not None and second[:2] == first[:2]
    c.release(first)  # the shared two are still held; the third goes back
    assert c.available == 1
    assert c.take([], 3) is None  # the shared blocks cannot be evicted while held
    c.release(second)
    assert c.available == 4 and c.cached_blocks == 2  # idle, still registered
    assert c.lookup(keys) == first[:2]


def test_idle_blocks_are_evicted_least_recently_used_and_only_for_room():
    c = cache(blocks=4)
    old, new = block_keys([1] * 4, BLOCK, 1), block_keys([2] * 4, BLOCK, 1)
    a = c.take([], 1)
    b = c.take([], 1)
    assert a is not None and b is not None
    c.register(a[0], old[0])
    c.register(b[0], new[0])
    c.release(a)
    c.release(b)
    assert c.take([], 2) is not None  # two free blocks: nothing evicted
    assert c.evicted == 0 and c.lookup(old) == a
    assert c.take([], 1) is not None  # room only by evicting: the older one goes
    assert c.evicted == 1 and c.lookup(old) == [] and c.lookup(new) == b


def test_taking_a_cached_block_makes_it_the_most_recently_used():
    c = cache(blocks=3)
    keys = [block_keys([n] * 4, BLOCK, 1) for n in range(3)]
    blocks = []
    for key in keys:
        got = c.take([], 1)
        assert got is not None
        c.register(got[0], key[0])
        c.release(got)
        blocks.append(got[0])
    again = c.take(c.lookup(keys[0]), 0)  # the oldest, used again
    assert again == [blocks[0]]
    c.release(again)
    assert c.take([], 1) is not None
    assert c.lookup(keys[0]) == [blocks[0]] and c.lookup(keys[1]) == []


def test_a_full_cache_takes_nothing_and_double_release_is_refused():
    c = cache(blocks=2)
    got = c.take([], 2)
    assert got is not None and c.take([], 1) is None
    c.release(got)
    with pytest.raises(ValueError, match="twice or never taken"):
        c.release(got[:1])


def test_a_key_already_registered_keeps_its_block_and_off_means_no_reuse():
    c = cache()
    key = block_keys([4] * 4, BLOCK, 1)
    a, b = c.take([], 1), c.take([], 1)
    assert a is not None and b is not None
    c.register(a[0], key[0])
    c.register(b[0], key[0])  # the same tokens computed twice (two requests raced)
    assert c.lookup(key) == a and c.cached_blocks == 1
    c.release(b)
    assert c.available == 7  # the unregistered copy went straight back
    with pytest.raises(ValueError, match="nobody holds"):
        c.register(b[0], block_keys([5] * 4, BLOCK, 1)[0])
    off = cache(enabled=False)
    got = off.take([], 1)
    assert got is not None
    off.register(got[0], key[0])
    assert off.lookup(key) == [] and off.cached_blocks == 0


def test_eviction_goes_on_while_that_makes_one_run_of_adjacent_blocks():
    c = cache(blocks=6)
    held = [c.take([], 3), c.take([], 3)]  # two requests of three blocks, their first two registered
    assert held == [[0, 1, 2], [3, 4, 5]]
    for got in held:
        for block in got[:2]:
            c.register(block, block_keys([block] * 4, BLOCK, 1)[0])
        c.release(got)
    assert c.allocator.free == 2 and c.allocator.runs == 2  # blocks 2 and 5: apart
    assert c.take([], 3) == [0, 1, 2]  # one eviction was room enough; the second made a run
    assert c.evicted == 2 and c.lookup(block_keys([3] * 4, BLOCK, 1)) == [3]


def test_a_namespace_root_separates_tenants_and_salts_and_is_empty_only_for_none():
    from kvasir.sched.prefix import namespace_root

    assert namespace_root("", None) == b""  # prefix_share = "all", no salt: the unsalted chain
    roots = [
        namespace_root(namespace, salt)
        for namespace, salt in [
            ("key:a", None),
            ("key:b", None),
            ("key:a", "s"),
            ("key:a", ""),
            ("", "s"),
            ("", ""),
            ("ab", "c"),  # length-prefixed parts: these two cannot meet
            ("a", "bc"),
        ]
    ]
    assert len(set(roots)) == len(roots) and all(len(root) == 16 for root in roots)
    assert namespace_root("key:a", "s") == namespace_root("key:a", "s")  # stable: the same tenant hits
    keys = block_keys([1, 2, 3, 4], BLOCK, 1, parent=roots[0])
    assert keys != block_keys([1, 2, 3, 4], BLOCK, 1, parent=roots[1])


def test_registrations_and_evictions_become_events_for_the_conductor(monkeypatch):
    c = cache(blocks=2)
    keys = block_keys(list(range(8)), BLOCK, 2)
    assert c.take_events() is None
    held = c.take([], 2)
    assert held is not None
    c.register(held[0], keys[0])
    c.register(held[0], keys[0])  # known already: no second event
    c.register(held[1], keys[1])
    assert c.take_events() == ([keys[0], keys[1]], [], False)
    assert c.take_events() is None
    c.release(held)
    assert c.take([], 2) is not None  # room only by evicting both idle blocks
    assert c.take_events() == ([], [keys[0], keys[1]], False)
    monkeypatch.setattr("kvasir.sched.prefix.EVENTS_KEPT", 1)  # more than that: a snapshot instead
    c = cache(blocks=2)
    held = c.take([], 2)
    assert held is not None
    c.register(held[0], keys[0])
    c.register(held[1], keys[1])
    assert c.take_events() == ([keys[0], keys[1]], [], True)
