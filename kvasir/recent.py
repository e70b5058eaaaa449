"""A bounded memory of recent keys: the request ids a head saw end before it heard of
them, the clients the bridge lost. Once ``limit`` keys are kept, adding one forgets the
oldest."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class Recent(Generic[K]):
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._keys: OrderedDict[K, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: K) -> bool:
        return key in self._keys

    def add(self, key: K) -> None:
        self._keys[key] = None
        if len(self._keys) > self.limit:
            self._keys.popitem(last=False)

    def take(self, key: K) -> bool:
        """Was ``key`` kept (added and not taken since)? Forgets it."""
        return self._keys.pop(key, 0) is None
