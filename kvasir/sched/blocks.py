"""KV block bookkeeping at the head: which block ids are free.

Kept apart from scheduling policy: the scheduler decides who gets blocks, this only
hands them out and takes them back, refusing double frees. A request gets one run of
adjacent block ids whenever a free run is long enough (the lowest such run), so the
stages read its keys as one view of their caches (kvasir/model/paged_inplace.py); only
when free blocks are scattered does it get several runs, lowest ids first.
"""

from __future__ import annotations

import bisect


class BlockAllocator:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._starts: list[int] = [0] if num_blocks else []  # free runs' first ids, ascending
        self._length: dict[int, int] = {0: num_blocks} if num_blocks else {}  # run start -> length
        self._free = num_blocks
        self._out: set[int] = set()

    @property
    def free(self) -> int:
        return self._free

    @property
    def longest_run(self) -> int:
        """The most adjacent free blocks (0 when none is free)."""
        return max(self._length.values(), default=0)

    @property
    def runs(self) -> int:
        """How many separate runs the free blocks form (1 when nothing is scattered)."""
        return len(self._starts)

    def allocate(self, count: int) -> list[int] | None:
        """``count`` block ids, or None (and nothing taken) when fewer are free."""
        if count > self._free:
            return None
        for start in self._starts:
            if self._length[start] >= count:
                taken = self._cut(start, count)
                break
        else:
            taken = []
            while len(taken) < count:
                start = self._starts[0]
                taken += self._cut(start, min(self._length[start], count - len(taken)))
        self._out.update(taken)
        self._free -= count
        return taken

    def release(self, blocks: list[int]) -> None:
        """Give blocks back; a block that is not out (freed twice, never taken) raises
        ValueError and nothing is given back."""
        if len(set(blocks)) != len(blocks) or not self._out.issuperset(blocks):
            bad = next(b for i, b in enumerate(blocks) if b not in self._out or b in blocks[:i])
            raise ValueError(f"KV block {bad} given back twice or never taken")
        self._out.difference_update(blocks)
        self._free += len(blocks)
        for block in sorted(blocks):
            self._insert(block)

    def _cut(self, start: int, count: int) -> list[int]:
        """Take the first ``count`` ids of the free run at ``start``."""
        length = self._length.pop(start)
        index = bisect.bisect_left(self._starts, start)
        if length > count:
            self._starts[index] = start + count
            self._length[start + count] = length - count
        else:
            del self._starts[index]
        return list(range(start, start + count))

    def _insert(self, block: int) -> None:
        """Free one block, joining the runs on either side."""
        index = bisect.bisect_left(self._starts, block)
        before = self._starts[index - 1] if index else None
        joins_before = before is not None and before + self._length[before] == block
        joins_after = index < len(self._starts) and self._starts[index] == block + 1
        if joins_before and joins_after:
            after = self._starts.pop(index)
            self._length[before] += 1 + self._length.pop(after)  # type: ignore[index]
        elif joins_before:
            self._length[before] += 1  # type: ignore[index]
        elif joins_after:
            self._starts[index] = block
            self._length[block] = 1 + self._length.pop(block + 1)
        else:
            self._starts.insert(index, block)
            self._length[block] = 1
