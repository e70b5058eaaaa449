"""The free list behind KV blocks and slot credits."""

import pytest

from kvasir.freelist import FreeList
from kvasir.ring.shm import SlotError
from kvasir.ring.slots import SlotCredits


def test_ids_come_back_oldest_freed_first_and_all_or_nothing():
    ids = FreeList(4, ValueError, "thing")
    assert ids.take(3) == [0, 1, 2]
    assert ids.take(2) is None and ids.free == 1  # nothing taken when too few are free
    ids.give_back([1, 0])
    assert ids.take(3) == [3, 1, 0]


def test_an_id_given_back_twice_or_never_taken_is_refused_and_changes_nothing():
    ids = FreeList(2, ValueError, "thing")
    taken = ids.take(1)
    ids.give_back(taken)
    with pytest.raises(ValueError, match="thing 0 given back twice or never taken"):
        ids.give_back(taken)
    with pytest.raises(ValueError, match="thing 1"):
        ids.give_back([1])
    assert ids.free == 2


def test_slot_credits_refuse_double_frees_with_their_own_error():
    credits = SlotCredits(2)
    slots = [credits.take(), credits.take()]
    assert not credits.available
    with pytest.raises(SlotError):
        credits.take()
    credits.give_back(slots[0])
    with pytest.raises(SlotError, match="credit for slot 0"):
        credits.give_back(slots[0])
    assert credits.available
