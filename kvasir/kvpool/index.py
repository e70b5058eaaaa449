"""What the pool holds, as the conductor sees it: for each block key, which stage slices
(a layer range on a host) are stored, and in which of that host's tiers. An instance
can read a block back only when each of its stages finds its own slice on its own host:
a block is complete only when every stage's slice is stored, and only complete blocks
are ever used.

Fed by the stages' reports of slices stored and removed (``PoolEvents``); a host that
disappears takes everything it held out of the index at once (``forget_host``). The
index is bounded: past ``max_keys`` block keys, the least recently stored or used go.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Literal

Tier = Literal["host", "disk", "remote"]  # remote: read from another host's pool (never stored as such)
Layers = tuple[int, int]
Slot = tuple[str, Layers]  # a stage's slice of any block: its host and its layers


class PoolIndex:
    """Slices by block key and slot, each with the tiers holding it."""

    def __init__(self, max_keys: int) -> None:
        self.max_keys = max_keys
        self._slices: OrderedDict[bytes, dict[Slot, set[Tier]]] = OrderedDict()  # least recently touched first

    def __len__(self) -> int:
        return len(self._slices)

    def stored(self, key: bytes, slot: Slot, tier: Tier) -> None:
        self._slices.setdefault(key, {}).setdefault(slot, set()).add(tier)
        self._slices.move_to_end(key)
        while len(self._slices) > self.max_keys:
            self._slices.popitem(last=False)

    def removed(self, key: bytes, slot: Slot, tier: Tier) -> None:
        slots = self._slices.get(key)
        if slots is None or slot not in slots:
            return
        slots[slot].discard(tier)
        if not slots[slot]:
            del slots[slot]
        if not slots:
            del self._slices[key]

    def reset(self, slot: Slot, tier: Tier) -> None:
        """Forget everything ``slot`` held in ``tier`` (a snapshot of it follows)."""
        for key in list(self._slices):
            self.removed(key, slot, tier)

    def forget_host(self, host: str) -> int:
        """Everything ``host`` held leaves the index (the host is gone); how many slices went."""
        gone = 0
        for key in list(self._slices):
            slots = self._slices[key]
            for slot in [s for s in slots if s[0] == host]:
                gone += len(slots.pop(slot))
            if not slots:
                del self._slices[key]
        return gone

    def tiers(self, key: bytes, layout: Sequence[Slot]) -> set[Tier] | None:
        """Where each stage of an instance of ``layout`` finds its slice of block ``key``:
        the tiers every stage has it in, {"disk"} where one has it on disk only, None
        where one has it nowhere (the block is not complete for the instance)."""
        slots = self._slices.get(key)
        if slots is None:
            return None
        common: set[Tier] = {"host", "disk"}
        for slot in layout:
            held = slots.get(slot)
            if not held:
                return None
            common &= held
        return common or {"disk"}

    def reach(self, keys: Sequence[bytes], layout: Sequence[Slot]) -> tuple[int, list[str | None]]:
        """How many of a prompt's chained block ``keys``, from the first, an instance of
        ``layout`` can read back when each stage may also read what its own host lacks
        from one other host holding its layers; and that host per stage (None: its own
        is enough). Each is now most recently used."""
        sources: list[str | None] = []
        count = len(keys)
        for host, layers in layout:
            local = self._run(keys, {(host, layers)})
            best, source = local, None
            for other in self._hosts_with(keys[local], layers, host) if local < len(keys) else ():
                run = self._run(keys, {(host, layers), (other, layers)})
                if run > best:
                    best, source = run, other
            sources.append(source)
            count = min(count, best)
        for key in keys[:count]:
            self._slices.move_to_end(key)
        return count, sources

    def held(self, keys: Sequence[bytes], slot: Slot) -> int:
        """How many of ``keys``, from the first, ``slot`` holds."""
        return self._run(keys, {slot})

    def _run(self, keys: Sequence[bytes], wanted: set[Slot]) -> int:
        """How many of ``keys``, from the first, one of the ``wanted`` slots holds."""
        count = 0
        for key in keys:
            slots = self._slices.get(key)
            if slots is None or wanted.isdisjoint(slots):
                break
            count += 1
        return count

    def _hosts_with(self, key: bytes, layers: Layers, besides: str) -> list[str]:
        return sorted({host for host, held in self._slices.get(key, {}) if held == layers and host != besides})

    def longest(self, keys: Iterable[bytes], layout: Sequence[Slot]) -> int:
        """How many of a prompt's chained block ``keys``, from the first, are complete for
        an instance of ``layout`` (each is now most recently used)."""
        count = 0
        for key in keys:
            if self.tiers(key, layout) is None:
                break
            self._slices.move_to_end(key)
            count += 1
        return count
