"""Boundary slot rings: preallocated buffers a producer stage writes and its consumer reads.

An edge between stage k and stage k+1 has ``slots`` buffers of ``max_tokens x hidden``
(the largest boundary the plan allows), so nothing is allocated per batch. The producer
writes into a free slot and sends a descriptor naming it; the consumer reads it in place
and returns a credit. ``SlotCredits`` is the producer's view of which slots are free.

Kinds: ``shm`` (POSIX shared memory, CPU stages on one host) is implemented here; CUDA
IPC buffers, pinned host memory and zero-copy frames implement the same ``SlotRing``
interface and are chosen per edge by ``EdgeSpec.kind``.
"""

from __future__ import annotations

import mmap
import os
from collections import deque
from pathlib import Path
from typing import Protocol

import torch

from kvasir.errors import KvasirError
from kvasir.messages import EdgeSpec, KvSegment
from kvasir.model.kv_cache import PagedKVCache
from kvasir.model.loader import DTYPES

SHM_DIR = Path("/dev/shm")


class SlotError(KvasirError):
    """A slot index or boundary size outside what the edge was built for."""


class SlotRing(Protocol):
    def write(self, slot: int, boundary: torch.Tensor) -> None: ...

    def read(self, slot: int, num_tokens: int) -> torch.Tensor: ...

    def close(self) -> None: ...


def edge_bytes(spec: EdgeSpec) -> int:
    return spec.slots * spec.max_tokens * spec.hidden * DTYPES[spec.dtype].itemsize


class ShmSlotRing:
    """A slot ring in one POSIX shared-memory segment (a file under /dev/shm)."""

    def __init__(self, spec: EdgeSpec, create: bool) -> None:
        self.spec = spec
        self.path = SHM_DIR / spec.name
        self._map = _map_file(self.path, edge_bytes(spec), create)
        flat = torch.frombuffer(self._map, dtype=torch.uint8)
        self._slots = flat.view(DTYPES[spec.dtype]).view(spec.slots, spec.max_tokens, spec.hidden)

    def _check(self, slot: int, num_tokens: int) -> None:
        if not 0 <= slot < self.spec.slots:
            raise SlotError(f"edge {self.spec.name}: slot {slot} outside [0, {self.spec.slots})")
        if not 0 < num_tokens <= self.spec.max_tokens:
            raise SlotError(f"edge {self.spec.name}: {num_tokens} tokens do not fit a {self.spec.max_tokens}-token slot")

    def write(self, slot: int, boundary: torch.Tensor) -> None:
        self._check(slot, boundary.shape[0])
        self._slots[slot, : boundary.shape[0]].copy_(boundary)

    def read(self, slot: int, num_tokens: int) -> torch.Tensor:
        """The boundary in place (no copy): valid until the slot's credit is returned."""
        self._check(slot, num_tokens)
        return self._slots[slot, :num_tokens]

    def close(self) -> None:
        self._slots = None
        _close_map(self._map)

    def unlink(self) -> None:
        self.path.unlink(missing_ok=True)


def create_ring(spec: EdgeSpec) -> ShmSlotRing:
    """Create an edge's buffers (the launcher does this once, before spawning stages)."""
    if spec.kind != "shm":
        raise SlotError(f"slot kind {spec.kind!r} is not available in this version")
    return ShmSlotRing(spec, create=True)


def attach_ring(spec: EdgeSpec) -> SlotRing:
    """Attach a stage to an edge created by the launcher."""
    if spec.kind != "shm":
        raise SlotError(f"slot kind {spec.kind!r} is not available in this version")
    return ShmSlotRing(spec, create=False)


def kv_segment_bytes(spec: KvSegment) -> int:
    """Keys and values of every layer of a prefill stage's cache."""
    layers = spec.layers[1] - spec.layers[0]
    return PagedKVCache.bytes_needed(layers, spec.num_blocks, spec.block_size, spec.kv_heads, spec.head_dim, DTYPES[spec.dtype])


class KvSegmentMap:
    """A prefill stage's KV cache in one POSIX shared-memory segment: keys, then values.

    The launcher creates it; the prefill stage maps it as its cache; decode stages map it
    to copy handed-off requests' K/V out of it.
    """

    def __init__(self, spec: KvSegment, create: bool) -> None:
        self.spec = spec
        self.path = SHM_DIR / spec.name
        self._map = _map_file(self.path, kv_segment_bytes(spec), create)
        shape = (spec.layers[1] - spec.layers[0], spec.num_blocks * spec.block_size, spec.kv_heads, spec.head_dim)
        flat = torch.frombuffer(self._map, dtype=torch.uint8).view(DTYPES[spec.dtype])
        self.keys, self.values = flat.view(2, *shape).unbind(0)

    def close(self) -> None:
        self.keys = self.values = None
        _close_map(self._map)

    def unlink(self) -> None:
        self.path.unlink(missing_ok=True)


def _map_file(path: Path, size: int, create: bool) -> mmap.mmap:
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            os.ftruncate(fd, size)
        elif os.fstat(fd).st_size != size:
            raise SlotError(f"shared memory {path} has {os.fstat(fd).st_size} bytes, expected {size}")
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def _close_map(mapping: mmap.mmap) -> None:
    try:
        mapping.close()
    except BufferError:
        pass  # a view is still alive somewhere; the mapping goes with the process


class SlotCredits:
    """The producer's side of an edge: which slots are free to write."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self._free: deque[int] = deque(range(slots))
        self._busy: set[int] = set()

    @property
    def available(self) -> bool:
        return bool(self._free)

    def take(self) -> int:
        slot = self._free.popleft()
        self._busy.add(slot)
        return slot

    def give_back(self, slot: int) -> None:
        if slot not in self._busy:
            raise SlotError(f"credit for slot {slot}, which is not in use")
        self._busy.remove(slot)
        self._free.append(slot)
