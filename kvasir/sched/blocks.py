"""KV block bookkeeping at the head: which block ids are free.

Kept apart from scheduling policy: the scheduler decides who gets blocks, this only
hands them out and takes them back, refusing double frees (kvasir/freelist.py).
"""

from __future__ import annotations

from kvasir.freelist import FreeList


class BlockAllocator:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._list = FreeList(num_blocks, ValueError, "KV block")

    @property
    def free(self) -> int:
        return self._list.free

    def allocate(self, count: int) -> list[int] | None:
        """``count`` block ids, or None (and nothing taken) when fewer are free."""
        return self._list.take(count)

    def release(self, blocks: list[int]) -> None:
        self._list.give_back(blocks)
