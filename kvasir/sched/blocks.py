"""KV block bookkeeping at the head: which block ids are free.

Kept apart from scheduling policy: the scheduler decides who gets blocks, this only
hands them out and takes them back, refusing double frees.
"""

from __future__ import annotations

from collections import deque


class BlockAllocator:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._used: set[int] = set()

    @property
    def free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int] | None:
        """``count`` block ids, or None (and nothing taken) when fewer are free."""
        if count > len(self._free):
            return None
        blocks = [self._free.popleft() for _ in range(count)]
        self._used.update(blocks)
        return blocks

    def release(self, blocks: list[int]) -> None:
        for block in blocks:
            if block not in self._used:
                raise ValueError(f"KV block {block} released twice or never allocated")
            self._used.remove(block)
            self._free.append(block)
