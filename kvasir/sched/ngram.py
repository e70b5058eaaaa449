"""Prompt lookup, speculative decoding's drafter without a model: a request's next tokens
are guessed as what followed the latest earlier occurrence of its last few tokens, in
its prompt or its output. Strong where the output copies its input (editing,
summarising, code, retrieval-augmented prompts) or repeats itself.

One ``NgramIndex`` per request, extended as its output grows: each n-gram of the sizes
looked up maps to the position after its latest occurrence, so a lookup costs a few
dictionary probes whatever the length (bounded: sizes x tokens entries).
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramIndex:
    """A request's tokens and where each of their n-grams (``smallest`` to ``largest``
    tokens) last occurred with a token after it."""

    def __init__(self, smallest: int, largest: int) -> None:
        self.smallest = smallest
        self.largest = largest
        self.tokens: list[int] = []
        self._follows: dict[tuple[int, ...], int] = {}  # n-gram -> position of the token after its latest occurrence

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens: every n-gram ending just before each one now has a follower."""
        seen = self.tokens
        for token in tokens:
            end = len(seen)
            for n in range(self.smallest, min(self.largest, end) + 1):
                self._follows[tuple(seen[end - n : end])] = end
            seen.append(token)

    def propose(self, count: int) -> list[int]:
        """``count`` tokens continuing the longest suffix (of the sizes looked up) that
        occurred before; none where no suffix did. What followed that occurrence is
        copied; where the copy reaches the end, the tokens since the occurrence are taken
        to repeat (a loop's continuation is the loop)."""
        seen = self.tokens
        for n in range(min(self.largest, len(seen)), self.smallest - 1, -1):
            start = self._follows.get(tuple(seen[len(seen) - n :]))
            if start is not None:
                period = len(seen) - start
                return [seen[start + i % period] for i in range(count)]
        return []
