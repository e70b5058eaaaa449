"""Boundary slot rings: preallocated buffers a producer stage writes and its consumer reads.

An edge between stage k and stage k+1 has ``slots`` buffers of ``max_tokens x hidden``
(the largest boundary the plan allows), so nothing is allocated per batch. The producer
writes into a free slot and sends a descriptor naming it; the consumer reads it in place
and returns a credit. ``SlotCredits`` is the producer's view of which slots are free.

Kinds (chosen per edge by ``EdgeSpec.kind``, see kvasir/edges.py): ``shm`` (POSIX shared
memory) is here; ``pinned`` (the same memory, page-locked for CUDA) and ``cuda-ipc``
(buffers on the consumer's GPU) are in kvasir/gpu_slots.py, behind the same ``SlotRing``
interface. The launcher creates the shared-memory files of ``shm`` and ``pinned`` edges;
``cuda-ipc`` buffers are made by the consuming stage and opened by the producing one.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
from collections import deque
from pathlib import Path
from typing import Protocol

import torch

from kvasir.errors import KvasirError
from kvasir.messages import EdgeSpec, KvSegment
from kvasir.model.kv_cache import PagedKVCache
from kvasir.model.loader import DTYPES
from kvasir.pids import alive

SHM_DIR = Path("/dev/shm")
SEGMENT_NAME = re.compile(r"kvasir-(?P<pid>[0-9]+)-[0-9a-f]{8}-[a-z]+[0-9]*")  # segment_prefix() + "-edge3", "-kv0", "-hop"


def segment_prefix() -> str:
    """The start of every shared-memory segment this process creates: it names the
    creator's pid, so a later daemon can tell segments whose creator is gone."""
    return f"kvasir-{os.getpid()}-{secrets.token_hex(4)}"


def sweep_stale_segments(directory: Path = SHM_DIR) -> list[tuple[Path, int]]:
    """Remove this user's segments whose creator no longer runs (a daemon or bench killed
    with SIGKILL, or by the OOM killer, cannot remove its own). Segments of live
    processes, other users' files and other names are left alone. Returns the removed
    files with their sizes."""
    removed = []
    try:
        entries = list(directory.iterdir())
    except OSError:
        return removed
    for path in entries:
        match = SEGMENT_NAME.fullmatch(path.name)
        if match is None or alive(int(match["pid"])):
            continue
        try:
            info = path.lstat()
            if info.st_uid != os.getuid():
                continue
            path.unlink()
        except OSError:
            continue  # gone already, or not ours to remove
        removed.append((path, info.st_size))
    return removed


class SlotError(KvasirError):
    """A slot index or boundary size outside what the edge was built for."""


class SlotRing(Protocol):
    spec: EdgeSpec

    def write(self, slot: int, boundary: torch.Tensor) -> None:
        """Producer: put a boundary into a free slot (it is readable once the descriptor arrives)."""

    def read(self, slot: int, num_tokens: int) -> torch.Tensor:
        """Consumer: the boundary in a slot, on the consumer's device."""

    def release(self, slot: int) -> None:
        """Consumer: done with the slot (the work reading it is queued); its credit goes next."""

    def close(self) -> None: ...


def check_slot(spec: EdgeSpec, slot: int, num_tokens: int) -> None:
    """A slot index and boundary size within what the edge was built for (else SlotError)."""
    if not 0 <= slot < spec.slots:
        raise SlotError(f"edge {spec.name}: slot {slot} outside [0, {spec.slots})")
    if not 0 < num_tokens <= spec.max_tokens:
        raise SlotError(f"edge {spec.name}: {num_tokens} tokens do not fit a {spec.max_tokens}-token slot")


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
        check_slot(self.spec, slot, num_tokens)

    def write(self, slot: int, boundary: torch.Tensor) -> None:
        self._check(slot, boundary.shape[0])
        self._slots[slot, : boundary.shape[0]].copy_(boundary)

    def read(self, slot: int, num_tokens: int) -> torch.Tensor:
        """The boundary in place (no copy): valid until the slot's credit is returned."""
        self._check(slot, num_tokens)
        return self._slots[slot, :num_tokens]

    def release(self, slot: int) -> None:
        pass  # reads happen in place and the CPU work reading it has finished

    def close(self) -> None:
        self._slots = None
        _close_map(self._map)

    def unlink(self) -> None:
        self.path.unlink(missing_ok=True)


SHARED_MEMORY_KINDS = ("shm", "pinned")  # edges whose buffers the launcher creates


def create_ring(spec: EdgeSpec) -> ShmSlotRing:
    """Create a shared-memory edge's buffers (the launcher does this once, before spawning stages)."""
    if spec.kind not in SHARED_MEMORY_KINDS:
        raise SlotError(f"edge {spec.name}: {spec.kind!r} slots are not made by the launcher")
    return ShmSlotRing(spec, create=True)


def attach_ring(spec: EdgeSpec, side: str) -> SlotRing:
    """A stage's end of an edge: ``side`` is "producer" or "consumer". A ``cuda-ipc``
    ring still needs the handle exchange (kvasir/handshake.py) before use."""
    if side not in ("producer", "consumer"):
        raise SlotError(f"edge {spec.name}: side {side!r} is neither producer nor consumer")
    if spec.kind == "shm":
        return ShmSlotRing(spec, create=False)
    if spec.kind in ("pinned", "cuda-ipc"):
        from kvasir.gpu_slots import CudaIpcSlotRing, PinnedSlotRing

        return PinnedSlotRing(spec, side) if spec.kind == "pinned" else CudaIpcSlotRing(spec, side)
    raise SlotError(f"edge {spec.name}: unknown slot kind {spec.kind!r}")


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
