"""The head's KV block allocator: one run of adjacent ids per request whenever it can."""

import random

import pytest

from kvasir.sched.blocks import BlockAllocator


def test_each_request_gets_the_lowest_run_long_enough():
    blocks = BlockAllocator(10)
    a, b, c = blocks.allocate(3), blocks.allocate(2), blocks.allocate(4)
    assert (a, b, c) == ([0, 1, 2], [3, 4], [5, 6, 7, 8])
    blocks.release(a)
    assert blocks.allocate(2) == [0, 1]  # the lowest free run that fits
    assert blocks.runs == 2  # 2 and 9 are free, apart
    assert blocks.allocate(2) == [2, 9]


def test_scattered_blocks_are_handed_out_lowest_first_when_no_run_fits():
    blocks = BlockAllocator(6)
    taken = [blocks.allocate(1) for _ in range(6)]
    for got in taken[::2]:
        blocks.release(got)
    assert blocks.free == 3 and blocks.runs == 3
    assert blocks.allocate(4) is None and blocks.free == 3  # all or nothing
    assert blocks.allocate(3) == [0, 2, 4]
    assert blocks.free == 0 and blocks.runs == 0


def test_freed_neighbours_join_into_one_run():
    blocks = BlockAllocator(8)
    parts = [blocks.allocate(2) for _ in range(4)]
    for index in (0, 2, 1, 3):  # in an order that joins on both sides
        blocks.release(parts[index])
    assert blocks.runs == 1 and blocks.free == 8
    assert blocks.allocate(8) == list(range(8))


def test_a_block_given_back_twice_or_never_taken_is_refused_and_changes_nothing():
    blocks = BlockAllocator(4)
    got = blocks.allocate(2)
    blocks.release(got)
    with pytest.raises(ValueError, match="KV block 0 given back twice or never taken"):
        blocks.release(got)
    kept = blocks.allocate(1)
    with pytest.raises(ValueError, match="KV block 3"):
        blocks.release([*kept, 3])
    with pytest.raises(ValueError, match="KV block 0"):
        blocks.release([0, 0])
    assert blocks.free == 3
    blocks.release(kept)
    assert blocks.free == 4 and blocks.runs == 1


def test_random_churn_never_loses_or_duplicates_a_block():
    rng = random.Random(7)
    blocks = BlockAllocator(64)
    held: list[list[int]] = []
    for _ in range(2000):
        if held and (rng.random() < 0.5 or blocks.free == 0):
            blocks.release(held.pop(rng.randrange(len(held))))
        else:
            got = blocks.allocate(rng.randint(1, 9))
            if got is not None:
                held.append(got)
        out = [b for run in held for b in run]
        assert len(out) == len(set(out)) and blocks.free == 64 - len(out)
    for run in held:
        blocks.release(run)
    assert blocks.runs == 1 and blocks.allocate(64) == list(range(64))
