"""A free list of the ids 0..size-1: the head's KV blocks and a producer's slot credits.

Ids are handed out oldest-freed first and each one taken must come back exactly once:
giving back an id that is not out (twice, or never taken) raises the owner's error and
changes nothing.
"""

from __future__ import annotations

from collections import deque


class FreeList:
    def __init__(self, size: int, error: type[Exception], what: str) -> None:
        self.size = size
        self._error = error
        self._what = what  # names an id in errors: "KV block", "slot"
        self._free: deque[int] = deque(range(size))
        self._out: set[int] = set()

    @property
    def free(self) -> int:
        return len(self._free)

    def take(self, count: int) -> list[int] | None:
        """``count`` ids, or None (and nothing taken) when fewer are free."""
        if count > len(self._free):
            return None
        ids = [self._free.popleft() for _ in range(count)]
        self._out.update(ids)
        return ids

    def give_back(self, ids: list[int]) -> None:
        for item in ids:
            if item not in self._out:
                raise self._error(f"{self._what} {item} given back twice or never taken")
            self._out.remove(item)
            self._free.append(item)
