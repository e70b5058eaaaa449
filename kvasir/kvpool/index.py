"""What the pool holds, as the conductor sees it: for each block key, which stage slices
are stored where (a host and a tier). A block is usable from a place only when every
slice its instance's layout needs is there: a block is complete only when every stage's
slice is stored, and only complete blocks are ever used.

Fed by the stages' reports of slices stored and dropped; a host that disappears takes
everything it held out of the index at once (``forget_host``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

Tier = Literal["host", "disk"]
Layers = tuple[int, int]


@dataclass(frozen=True)
class Place:
    host: str
    tier: Tier


@dataclass
class PoolIndex:
    """Slices by block key and place."""

    _slices: dict[bytes, dict[Place, set[Layers]]] = field(default_factory=dict)

    def stored(self, key: bytes, place: Place, layers: Layers) -> None:
        self._slices.setdefault(key, {}).setdefault(place, set()).add(layers)

    def dropped(self, key: bytes, place: Place, layers: Layers) -> None:
        places = self._slices.get(key)
        if places is None or place not in places:
            return
        places[place].discard(layers)
        if not places[place]:
            del places[place]
        if not places:
            del self._slices[key]

    def forget_host(self, host: str) -> int:
        """Everything ``host`` held leaves the index (the host is gone); how many slices went."""
        gone = 0
        for key in list(self._slices):
            places = self._slices[key]
            for place in [p for p in places if p.host == host]:
                gone += len(places.pop(place))
            if not places:
                del self._slices[key]
        return gone

    def places(self, key: bytes, layout: Sequence[Layers]) -> list[Place]:
        """Where block ``key`` is complete for an instance of ``layout`` (its stages' layer ranges)."""
        need = set(layout)
        return [place for place, held in self._slices.get(key, {}).items() if need <= held]

    def longest(self, keys: Iterable[bytes], layout: Sequence[Layers], place: Place) -> int:
        """How many of a prompt's chained block ``keys``, from the first, are complete at ``place``."""
        count = 0
        for key in keys:
            if place not in self.places(key, layout):
                break
            count += 1
        return count

    def __len__(self) -> int:
        return len(self._slices)
