"""Slot rings for edges with a CUDA stage on one side or both.

``PinnedSlotRing``: the launcher's shared-memory slots, registered as page-locked memory
by each CUDA side, so device-to-host and host-to-device copies are DMA copies with no
staging buffer. A CUDA producer waits for its copy to land before the descriptor goes
(the consumer may be a CPU process that cannot wait on a CUDA event); a CUDA consumer
copies the slot to its device asynchronously and returns the credit once that copy is
done.

``CudaIpcSlotRing``: slot buffers preallocated once on the consumer's device and opened by
the producer through CUDA IPC. Per slot there are two interprocess events: "written"
(made by the producer, recorded after its device copy into the slot; the consumer's
stream waits on it before reading) and "read" (made by the consumer, recorded once the
work reading the slot is queued; the producer's stream waits on it before writing the
slot again). Credits work as on CPU; no host synchronisation happens per batch. The
handles (memory and events) are exchanged once at start-up (kvasir/ring/handshake.py).
"""

from __future__ import annotations

import os

import torch

from kvasir.config.devices import cuda_ordinal, torch_dtype
from kvasir.ring.slots import ShmSlotRing, SlotError, check_slot, edge_bytes
from kvasir.wire.base import Side
from kvasir.wire.control import CudaMemoryHandle, EdgeHandles, EdgeSpec

HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: page-locked for every CUDA context of the process


def register_host(pointer: int, size: int, what: str) -> int:
    """Page-lock ``size`` bytes of host memory at ``pointer`` for CUDA copies; the pointer."""
    status = int(torch.cuda.cudart().cudaHostRegister(pointer, size, HOST_REGISTER_PORTABLE))
    if status != 0:
        raise SlotError(f"{what}: cudaHostRegister of {size} bytes failed (cudaError {status})")
    return pointer


def unregister_host(pointer: int, what: str) -> None:
    status = int(torch.cuda.cudart().cudaHostUnregister(pointer))
    if status != 0:
        raise SlotError(f"{what}: cudaHostUnregister failed (cudaError {status})")


def _side_device(spec: EdgeSpec, side: Side) -> str:
    return spec.producer if side == "producer" else spec.consumer


class PinnedSlotRing(ShmSlotRing):
    """Shared-memory slots, page-locked on the CUDA side(s) of the edge."""

    def __init__(self, spec: EdgeSpec, side: Side) -> None:
        super().__init__(spec, create=False)
        self.side = side
        device = _side_device(spec, side)
        self.device = torch.device(device) if cuda_ordinal(device) is not None else None
        self._registered: int | None = None
        self._events: list[torch.cuda.Event] = []
        if self.device is not None:
            self._registered = register_host(self._slots.data_ptr(), edge_bytes(spec), f"edge {spec.name}")
            # blocking: a wait for a copy sleeps in the driver instead of spinning a core
            self._events = [torch.cuda.Event(blocking=True) for _ in range(spec.slots)]

    def write(self, slot: int, boundary: torch.Tensor) -> None:
        self._check(slot, boundary.shape[0])
        target = self._slots[slot, : boundary.shape[0]]
        if not boundary.is_cuda:
            target.copy_(boundary)
            return
        target.copy_(boundary, non_blocking=True)
        event = self._events[slot]
        event.record(torch.cuda.current_stream(boundary.device))
        event.synchronize()  # the descriptor may go to a CPU stage: the bytes must be there first

    def read(self, slot: int, num_tokens: int) -> torch.Tensor:
        view = super().read(slot, num_tokens)
        if self.device is None:
            return view
        on_device = view.to(self.device, non_blocking=True)
        self._events[slot].record(torch.cuda.current_stream(self.device))
        return on_device

    def release(self, slot: int) -> None:
        if self.device is not None:
            self._events[slot].synchronize()  # the copy out of the slot has finished: it may be overwritten

    def close(self) -> None:
        registered, self._registered = self._registered, None
        try:
            if registered is not None:
                unregister_host(registered, f"edge {self.spec.name}")
        finally:
            super().close()


def export_memory(tensor: torch.Tensor) -> CudaMemoryHandle:
    """The IPC handle of a CUDA tensor's storage (torch's own storage sharing, no pickle)."""
    try:
        shared = tensor.untyped_storage()._share_cuda_()
    except RuntimeError as exc:
        raise SlotError(
            f"cannot share CUDA slot memory with the next stage ({exc}); with "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True some PyTorch versions cannot share "
            "memory at all: leave that setting out of the daemon's environment"
        ) from None
    device, handle, size, offset, ref_counter, ref_offset, event, event_sync = shared
    return CudaMemoryHandle(
        device=int(device),
        handle=bytes(handle),
        size=int(size),
        offset=int(offset),
        ref_counter=bytes(ref_counter or b""),
        ref_counter_offset=int(ref_offset),
        event=bytes(event or b""),
        event_sync=bool(event_sync),
    )


def import_memory(memory: CudaMemoryHandle, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Open another process's exported storage as a tensor of ``shape``."""
    storage = torch.UntypedStorage._new_shared_cuda(
        memory.device,
        memory.handle,
        memory.size,
        memory.offset,
        memory.ref_counter,
        memory.ref_counter_offset,
        memory.event,
        memory.event_sync,
    )
    needed = dtype.itemsize
    for n in shape:
        needed *= n
    if storage.nbytes() < needed:
        raise SlotError(f"shared CUDA memory holds {storage.nbytes()} bytes, the slots need {needed}")
    return torch.empty(0, dtype=dtype, device=torch.device("cuda", memory.device)).set_(storage, 0, shape)  # type: ignore[call-overload]  # torch's stub lacks this overload


def shareable_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeroed CUDA memory that another process can open through CUDA IPC. Memory in
    expandable segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) cannot be shared
    that way, so the allocator makes these buffers with the setting off, then restores it."""
    if not expandable_segments(os.environ):
        return torch.zeros(shape, dtype=dtype, device=device)
    settings = getattr(torch.cuda.memory, "_set_allocator_settings", None)
    if settings is None:
        raise SlotError(
            "PYTORCH_CUDA_ALLOC_CONF asks for expandable_segments:True, whose memory cannot be shared "
            "between stages, and this PyTorch cannot turn it off for the slots: leave the setting out"
        )
    settings("expandable_segments:False")
    try:
        return torch.zeros(shape, dtype=dtype, device=device)
    finally:
        settings("expandable_segments:True")


def expandable_segments(environ) -> bool:
    """Whether the CUDA allocator settings in ``environ`` turn expandable segments on."""
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        for option in environ.get(name, "").split(","):
            key, _, value = option.partition(":")
            if key.strip() == "expandable_segments" and value.strip().lower() == "true":
                return True
    return False


def _ipc_event(device: torch.device) -> torch.cuda.Event:
    event = torch.cuda.Event(interprocess=True)  # interprocess events carry no timing
    event.record(torch.cuda.current_stream(device))  # done once the stream's work so far (a zero-fill) is
    return event


class CudaIpcSlotRing:
    """Slots on the consumer's GPU; ``attach`` (with the other side's handles) before use."""

    def __init__(self, spec: EdgeSpec, side: Side) -> None:
        ordinal = cuda_ordinal(_side_device(spec, side))
        if ordinal is None or cuda_ordinal(spec.producer) is None or cuda_ordinal(spec.consumer) is None:
            raise SlotError(
                f"edge {spec.name}: CUDA IPC slots need CUDA stages on both sides ({spec.producer} -> {spec.consumer})"
            )
        self.spec = spec
        self.side = side
        self.device = torch.device("cuda", ordinal)
        self._shape = (spec.slots, spec.max_tokens, spec.hidden)
        self._dtype = torch_dtype(spec.dtype)
        self._slots = shareable_zeros(self._shape, self._dtype, self.device) if side == "consumer" else None
        # consumer: "read" events; producer: "written" events; recorded after the slots'
        # zero-fill, so a producer's first wait covers it
        self._own = [_ipc_event(self.device) for _ in range(spec.slots)]
        self._peer: list[torch.cuda.Event] = []

    def local_half(self, index: int, pid: int) -> EdgeHandles:
        return EdgeHandles(
            edge=self.spec.name,
            side=self.side,
            index=index,
            pid=pid,
            device=self.device.index,
            events=tuple(bytes(event.ipc_handle()) for event in self._own),
            memory=export_memory(self._slots) if self._slots is not None and self.side == "consumer" else None,
        )

    def attach(self, peer: EdgeHandles) -> None:
        other: Side = "consumer" if self.side == "producer" else "producer"
        expected = cuda_ordinal(_side_device(self.spec, other))
        if peer.edge != self.spec.name or peer.side != other:
            raise SlotError(f"edge {self.spec.name}: got the {peer.side} half of {peer.edge}")
        if peer.device != expected or len(peer.events) != self.spec.slots:
            raise SlotError(
                f"edge {self.spec.name}: the {other}'s handles name cuda:{peer.device} and {len(peer.events)} events, "
                f"expected cuda:{expected} and {self.spec.slots}"
            )
        if self.side == "producer":
            if peer.memory is None or peer.memory.device != expected:
                raise SlotError(
                    f"edge {self.spec.name}: the consumer's half carries no slot buffers on cuda:{expected}"
                )
            self._slots = import_memory(peer.memory, self._dtype, self._shape)
        self._peer = [torch.cuda.Event.from_ipc_handle(peer.device, handle) for handle in peer.events]

    def _checked(self, slot: int, num_tokens: int) -> torch.Tensor:
        """The slot buffers, once the handles are exchanged and the slot and size fit."""
        if not self._peer or self._slots is None:
            raise SlotError(f"edge {self.spec.name}: used before the CUDA IPC handles were exchanged")
        check_slot(self.spec, slot, num_tokens)
        return self._slots

    def write(self, slot: int, boundary: torch.Tensor) -> None:
        slots = self._checked(slot, boundary.shape[0])
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(self._peer[slot])  # the consumer's last read of this slot is done
        slots[slot, : boundary.shape[0]].copy_(boundary, non_blocking=True)  # runs on this device's stream
        self._own[slot].record(stream)

    def read(self, slot: int, num_tokens: int) -> torch.Tensor:
        slots = self._checked(slot, num_tokens)
        torch.cuda.current_stream(self.device).wait_event(self._peer[slot])  # the producer's copy is done
        return slots[slot, :num_tokens]

    def release(self, slot: int) -> None:
        self._own[slot].record(torch.cuda.current_stream(self.device))  # after the work reading the slot

    def close(self) -> None:
        if self._slots is not None and self._slots.is_cuda:
            torch.cuda.synchronize(self.device)
        self._slots = None
        self._peer = []
