"""The pool's index (kvasir/kvpool/index.py): a block counts at a place only when every
stage slice of the instance's layout is there, and a lost host takes its slices with it."""

from __future__ import annotations

from kvasir.kvpool.index import Place, PoolIndex

LAYOUT = [(0, 17), (17, 30)]
HOST_A, DISK_A, HOST_B = Place("a", "host"), Place("a", "disk"), Place("b", "host")


def test_a_block_is_complete_only_with_every_stage_slice():
    index = PoolIndex()
    index.stored(b"k1", HOST_A, (0, 17))
    assert index.places(b"k1", LAYOUT) == []
    index.stored(b"k1", HOST_A, (17, 30))
    index.stored(b"k1", DISK_A, (0, 17))
    assert index.places(b"k1", LAYOUT) == [HOST_A]
    assert index.places(b"k1", [(0, 10), (10, 30)]) == []  # another layout's slices are other slices
    index.dropped(b"k1", HOST_A, (17, 30))
    assert index.places(b"k1", LAYOUT) == []


def test_the_longest_complete_run_of_a_prompts_blocks():
    index = PoolIndex()
    for key in (b"k1", b"k2", b"k4"):
        for layers in LAYOUT:
            index.stored(key, HOST_A, layers)
    assert index.longest([b"k1", b"k2", b"k3", b"k4"], LAYOUT, HOST_A) == 2  # k3 missing: k4 cannot be used
    assert index.longest([b"k1"], LAYOUT, HOST_B) == 0


def test_a_lost_host_takes_its_slices_out():
    index = PoolIndex()
    for place in (HOST_A, DISK_A, HOST_B):
        for layers in LAYOUT:
            index.stored(b"k1", place, layers)
    assert index.forget_host("a") == 4
    assert index.places(b"k1", LAYOUT) == [HOST_B] and len(index) == 1
    assert index.forget_host("b") == 2 and len(index) == 0
    index.dropped(b"k9", HOST_A, (0, 17))  # dropping what is not there changes nothing
    assert len(index) == 0
