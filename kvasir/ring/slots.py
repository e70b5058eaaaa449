"""Boundary slot rings: preallocated buffers a producer stage writes and its consumer reads.

An edge between stage k and stage k+1 has ``slots`` buffers of ``max_tokens x hidden``
(the largest boundary the plan allows), so nothing is allocated per batch. The producer
writes into a free slot and sends a descriptor naming it; the consumer reads it in place
and returns a credit. ``SlotCredits`` is the producer's view of which slots are free.

Kinds (chosen per edge by ``EdgeSpec.kind``, see kvasir/ring/edges.py): ``shm`` (POSIX shared
memory) is here; ``pinned`` (the same memory, page-locked for CUDA) and ``cuda-ipc``
(buffers on the consumer's GPU) are in kvasir/ring/gpu_slots.py, behind the same ``SlotRing``
interface. The launcher creates the shared-memory files of ``shm`` and ``pinned`` edges;
``cuda-ipc`` buffers are made by the consuming stage and opened by the producing one.
"""

from __future__ import annotations

import warnings
from typing import Protocol

import torch

from kvasir.config.devices import torch_dtype
from kvasir.freelist import FreeList
from kvasir.ring.shm import SHM_DIR, SlotError, close_map, map_file
from kvasir.wire.control import EdgeSpec


class SlotRing(Protocol):
    spec: EdgeSpec

    def write(self, slot: int, boundary: torch.Tensor) -> None:
        """Producer: put a boundary into a free slot (it is readable once the descriptor arrives)."""

    def read(self, slot: int, num_tokens: int) -> torch.Tensor:
        """Consumer: the boundary in a slot, on the consumer's device."""

    def release(self, slot: int) -> None:
        """Consumer: done with the slot (the work reading it is queued); its credit goes next."""

    def close(self) -> None: ...


def received(buffer) -> torch.Tensor:
    """A received network frame's bytes as a uint8 tensor, without a copy. The frame is
    read-only and is only ever read from (copied into a slot, a cache or a buffer), so
    torch's warning about tensors over read-only memory is silenced here."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buffer, dtype=torch.uint8)


def check_slot(spec: EdgeSpec, slot: int, num_tokens: int) -> None:
    """A slot index and boundary size within what the edge was built for (else SlotError)."""
    if not 0 <= slot < spec.slots:
        raise SlotError(f"edge {spec.name}: slot {slot} outside [0, {spec.slots})")
    if not 0 < num_tokens <= spec.max_tokens:
        raise SlotError(f"edge {spec.name}: {num_tokens} tokens do not fit a {spec.max_tokens}-token slot")


def edge_bytes(spec: EdgeSpec) -> int:
    return spec.slots * spec.max_tokens * spec.hidden * torch_dtype(spec.dtype).itemsize


class ShmSlotRing:
    """A slot ring in one POSIX shared-memory segment (a file under /dev/shm)."""

    def __init__(self, spec: EdgeSpec, create: bool) -> None:
        self.spec = spec
        self.path = SHM_DIR / spec.name
        self._map = map_file(self.path, edge_bytes(spec), create)
        flat = torch.frombuffer(self._map, dtype=torch.uint8)
        self._slots = flat.view(torch_dtype(spec.dtype)).view(spec.slots, spec.max_tokens, spec.hidden)

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
        self._slots = None  # type: ignore[assignment]  # the mapping closes once no view of it is left
        close_map(self._map)

    def unlink(self) -> None:
        self.path.unlink(missing_ok=True)


class SlotCredits:
    """The producer's side of an edge: which slots are free to write (kvasir/freelist.py)."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self._list = FreeList(slots, SlotError, "credit for slot")

    @property
    def available(self) -> bool:
        return self._list.free > 0

    def take(self) -> int:
        taken = self._list.take(1)
        if taken is None:
            raise SlotError("no free slot to take (check available first)")
        return taken[0]

    def give_back(self, slot: int) -> None:
        self._list.give_back([slot])
