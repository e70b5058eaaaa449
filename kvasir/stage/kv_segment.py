"""A prefill stage's KV cache in one shared-memory segment, which decode stages read handed-off
requests' K/V from (the launcher creates it)."""

from __future__ import annotations

import torch

from kvasir.config.devices import torch_dtype
from kvasir.model.kv_cache import PagedKVCache
from kvasir.ring.shm import SHM_DIR, close_map, map_file
from kvasir.wire.control import KvSegment


def kv_segment_bytes(spec: KvSegment) -> int:
    """Keys and values of every layer of a prefill stage's cache."""
    layers = spec.layers[1] - spec.layers[0]
    return PagedKVCache.bytes_needed(
        layers, spec.num_blocks, spec.block_size, spec.kv_heads, spec.head_dim, torch_dtype(spec.dtype)
    )


class KvSegmentMap:
    """A prefill stage's KV cache in one POSIX shared-memory segment: keys, then values.

    The launcher creates it; the prefill stage maps it as its cache; decode stages map it
    to copy handed-off requests' K/V out of it.
    """

    def __init__(self, spec: KvSegment, create: bool) -> None:
        self.spec = spec
        self.path = SHM_DIR / spec.name
        self._map = map_file(self.path, kv_segment_bytes(spec), create)
        shape = (spec.layers[1] - spec.layers[0], spec.num_blocks * spec.block_size, spec.kv_heads, spec.head_dim)
        flat = torch.frombuffer(self._map, dtype=torch.uint8).view(torch_dtype(spec.dtype))
        self.keys, self.values = flat.view(2, *shape).unbind(0)

    def close(self) -> None:
        self.keys = self.values = None  # type: ignore[assignment]  # the mapping closes once no view of it is left
        close_map(self._map)

    def unlink(self) -> None:
        self.path.unlink(missing_ok=True)
