"""The pool's index (kvasir/kvpool/index.py): a block counts for an instance only when
each of its stages finds its slice on its own host, and a lost host takes its slices with it."""

from __future__ import annotations

from kvasir.kvpool.index import PoolIndex

LAYOUT = [("a", (0, 17)), ("a", (17, 30))]
SPLIT = [("a", (0, 17)), ("b", (17, 30))]  # an instance across two hosts


def test_a_block_is_complete_only_with_every_stage_slice():
    index = PoolIndex(max_keys=100)
    index.stored(b"k1", ("a", (0, 17)), "host")
    assert index.tiers(b"k1", LAYOUT) is None
    index.stored(b"k1", ("a", (17, 30)), "disk")
    assert index.tiers(b"k1", LAYOUT) == {"disk"}  # one stage has it on disk only: read at disk speed
    index.stored(b"k1", ("a", (17, 30)), "host")
    assert index.tiers(b"k1", LAYOUT) == {"host"}
    assert index.tiers(b"k1", [("a", (0, 10)), ("a", (10, 30))]) is None  # another layout's slices are other slices
    assert index.tiers(b"k1", SPLIT) is None  # host b holds nothing
    index.removed(b"k1", ("a", (17, 30)), "host")
    index.removed(b"k1", ("a", (17, 30)), "disk")
    assert index.tiers(b"k1", LAYOUT) is None


def test_the_longest_complete_run_of_a_prompts_blocks():
    index = PoolIndex(max_keys=100)
    for key in (b"k1", b"k2", b"k4"):
        for slot in LAYOUT:
            index.stored(key, slot, "disk")
    assert index.longest([b"k1", b"k2", b"k3", b"k4"], LAYOUT) == 2  # k3 missing: k4 cannot be used
    assert index.longest([b"k1"], SPLIT) == 0


def test_a_lost_host_and_a_reset_take_their_slices_out():
    index = PoolIndex(max_keys=100)
    for slot in [*LAYOUT, ("b", (17, 30))]:
        index.stored(b"k1", slot, "host")
        index.stored(b"k1", slot, "disk")
    assert index.tiers(b"k1", SPLIT) == {"host", "disk"}
    assert index.forget_host("b") == 2
    assert index.tiers(b"k1", SPLIT) is None and index.tiers(b"k1", LAYOUT) == {"host", "disk"}
    index.reset(("a", (0, 17)), "host")
    assert index.tiers(b"k1", LAYOUT) == {"disk"}
    assert index.forget_host("a") == 3 and len(index) == 0
    index.removed(b"k9", ("a", (0, 17)), "host")  # removing what is not there changes nothing
    assert len(index) == 0


def test_the_index_keeps_at_most_its_bound_of_keys_least_recently_touched_first():
    index = PoolIndex(max_keys=2)
    for key in (b"k1", b"k2"):
        for slot in LAYOUT:
            index.stored(key, slot, "disk")
    assert index.longest([b"k1"], LAYOUT) == 1  # k1 used: k2 is now the oldest
    for slot in LAYOUT:
        index.stored(b"k3", slot, "disk")
    assert len(index) == 2
    assert index.longest([b"k1"], LAYOUT) == 1 and index.longest([b"k2"], LAYOUT) == 0


def test_a_stage_reads_what_its_host_lacks_from_one_other_host_of_its_layers():
    index = PoolIndex(max_keys=100)
    keys = [b"k1", b"k2", b"k3", b"k4"]
    for key in keys[:2]:
        for slot in LAYOUT:
            index.stored(key, slot, "host")  # host a holds the first two blocks
    for key in keys:
        index.stored(key, ("b", (17, 30)), "disk")  # host b all four, of the second stage's layers only
        index.stored(key, ("c", (0, 17)), "host")  # host c all four, of the first stage's
    assert index.reach(keys, LAYOUT) == (4, ["c", "b"])
    assert index.reach(keys[:2], LAYOUT) == (2, [None, None])  # a has them: nobody else is asked
    assert index.reach(keys, [("a", (0, 10)), ("a", (10, 30))]) == (0, [None, None])  # nobody has those layers
    index.forget_host("c")
    assert index.reach(keys, LAYOUT) == (2, [None, "b"])  # the first stage finds only two anywhere
