"""Opening an edge's slot ring by its kind: the launcher creates shared-memory rings, each
stage attaches its end (``cuda-ipc`` rings still need the handle exchange, kvasir/ring/handshake.py;
``tcp`` rings carry the boundary in a frame after the descriptor, kvasir/ring/tcp_slots.py)."""

from __future__ import annotations

from kvasir.ring.slots import ShmSlotRing, SlotError, SlotRing
from kvasir.wire.base import Side
from kvasir.wire.control import EdgeSpec

SHARED_MEMORY_KINDS = ("shm", "pinned")  # edges whose buffers the launcher creates


def create_ring(spec: EdgeSpec) -> ShmSlotRing:
    """Create a shared-memory edge's buffers (the launcher does this once, before spawning stages)."""
    if spec.kind not in SHARED_MEMORY_KINDS:
        raise SlotError(f"edge {spec.name}: {spec.kind!r} slots are not made by the launcher")
    return ShmSlotRing(spec, create=True)


def attach_ring(spec: EdgeSpec, side: Side) -> SlotRing:
    """A stage's end of an edge: ``side`` is "producer" or "consumer". A ``cuda-ipc``
    ring still needs the handle exchange (kvasir/ring/handshake.py) before use."""
    if side not in ("producer", "consumer"):
        raise SlotError(f"edge {spec.name}: side {side!r} is neither producer nor consumer")
    if spec.kind == "shm":
        return ShmSlotRing(spec, create=False)
    if spec.kind == "tcp":
        from kvasir.ring.tcp_slots import TcpSlotRing

        return TcpSlotRing(spec, side)
    if spec.kind in ("pinned", "cuda-ipc"):
        from kvasir.ring.gpu_slots import CudaIpcSlotRing, PinnedSlotRing

        return PinnedSlotRing(spec, side) if spec.kind == "pinned" else CudaIpcSlotRing(spec, side)
    raise SlotError(f"edge {spec.name}: unknown slot kind {spec.kind!r}")
