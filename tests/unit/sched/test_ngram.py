"""Prompt lookup's index: the longest earlier suffix wins, its latest occurrence is
copied, a loop continues as the loop, and growing the index token by token gives what
building it at once does."""

from __future__ import annotations

from kvasir.sched.ngram import NgramIndex


def index(tokens, smallest=2, largest=4) -> NgramIndex:
    built = NgramIndex(smallest, largest)
    built.extend(tokens)
    return built


def test_copies_what_followed_the_earlier_occurrence_of_the_suffix():
    text = [5, 6, 7, 8, 9, 10, 11, 1, 2, 6, 7]
    assert index(text).propose(3) == [8, 9, 10]


def test_the_longest_suffix_that_occurred_wins_over_a_shorter_later_one():
    # "3 4" occurred last before 50, but "2 3 4" occurred (before 20): the longer match is trusted
    text = [2, 3, 4, 20, 21, 9, 3, 4, 50, 51, 2, 3, 4]
    assert index(text).propose(2) == [20, 21]
    assert index(text, largest=2).propose(2) == [50, 51]


def test_the_latest_occurrence_is_copied():
    text = [1, 2, 30, 1, 2, 40, 1, 2]
    assert index(text).propose(1) == [40]


def test_a_copy_reaching_the_end_continues_as_a_loop():
    assert index([7, 8, 9, 7, 8, 9, 7, 8]).propose(5) == [9, 7, 8, 9, 7]
    assert index([4, 4, 4]).propose(3) == [4, 4, 4]


def test_no_earlier_occurrence_proposes_nothing():
    assert index([1, 2, 3, 4, 5, 6]).propose(4) == []
    assert index([1]).propose(4) == []
    assert index([]).propose(4) == []


def test_growing_token_by_token_equals_building_at_once():
    text = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3, 2, 7, 9, 5, 1, 4, 1, 5]
    grown = NgramIndex(1, 3)
    for at, token in enumerate(text):
        grown.extend([token])
        assert grown.propose(3) == index(text[: at + 1], 1, 3).propose(3)
