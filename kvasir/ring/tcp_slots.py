"""The slots of an edge between two hosts (kind ``tcp``): the boundary crosses the network
as a second ZMQ frame after its descriptor.

The producer writes each boundary into a slot of its own, in host memory, and sends the
slot's bytes after the descriptor as a zero-copy frame (``FramedDescriptors``).
The consumer (``FramedIntake``) receives both, checks the bytes against the descriptor
(slot, tokens, size) and copies them into its own preallocated slot; from there on the
edge is the same as a shared-memory one: read in place, credit back when done, and
credits bound what is in flight exactly as they do on one host.

A frame that does not match its descriptor can only come from a bug or a hostile peer
(CURVE lets in only the plan's hosts): it raises ``EdgeError``, a worker failure that
supervision handles, never a ring left waiting for a batch that will not come.
"""

from __future__ import annotations

from typing import Any

import msgspec
import torch
import zmq

from kvasir.config.devices import cuda_ordinal, torch_dtype
from kvasir.errors import KvasirError
from kvasir.ring.slots import check_slot, received
from kvasir.transport.channels import waiting
from kvasir.wire.base import Side
from kvasir.wire.batch import BatchDescriptor
from kvasir.wire.control import EdgeSpec
from kvasir.wire.decoding import Decoder, Malformed


class EdgeError(KvasirError):
    """A malformed message on a network edge: the stage fails (and the ring restarts)."""


class TcpSlotRing:
    """One side's slots in host memory (page-locked where that side is on CUDA): the
    producer writes a boundary into a slot and sends the slot's bytes; the consumer
    copies what arrives into the same slot of its own."""

    def __init__(self, spec: EdgeSpec, side: Side) -> None:
        self.spec = spec
        self.side = side
        self.dtype = torch_dtype(spec.dtype)
        ordinal = cuda_ordinal(spec.consumer if side == "consumer" else spec.producer)
        self.device = torch.device("cpu") if ordinal is None else torch.device("cuda", ordinal)
        slots = torch.zeros(spec.slots, spec.max_tokens, spec.hidden, dtype=self.dtype)
        self._slots: torch.Tensor | None = slots.pin_memory() if self.device.type == "cuda" else slots
        self._written = [0] * spec.slots  # the producer's: tokens in each slot not yet sent

    def _slot(self, slot: int, num_tokens: int) -> torch.Tensor:
        check_slot(self.spec, slot, num_tokens)
        if self._slots is None:
            raise EdgeError(f"edge {self.spec.name}: the ring is closed")
        return self._slots[slot, :num_tokens]

    # -- the producer's side ----------------------------------------------------------------
    def write(self, slot: int, boundary: torch.Tensor) -> None:
        self._slot(slot, boundary.shape[0]).copy_(boundary)  # a CUDA boundary: waits for the copy
        self._written[slot] = boundary.shape[0]

    def frame(self, slot: int) -> memoryview:
        """The bytes of the boundary written into ``slot``, once. They stay in the slot, which
        is not written again before its credit returns, so ZMQ sends them without a copy."""
        tokens, self._written[slot] = self._written[slot], 0
        if tokens == 0:
            raise EdgeError(f"edge {self.spec.name}: slot {slot} has no boundary to send")
        array: Any = self._slot(slot, tokens).view(torch.uint8).numpy()  # shares the slot's memory
        return memoryview(array).cast("B")

    # -- the consumer's side ----------------------------------------------------------------
    def fill(self, slot: int, num_tokens: int, payload: memoryview) -> None:
        """Copy a received boundary into its slot, once its size is the descriptor's."""
        target = self._slot(slot, num_tokens)
        expected = num_tokens * self.spec.hidden * self.dtype.itemsize
        if payload.nbytes != expected:
            raise EdgeError(
                f"edge {self.spec.name}: a {num_tokens}-token boundary is {expected} bytes, the frame {payload.nbytes}"
            )
        target.view(-1).view(torch.uint8).copy_(received(payload))

    def read(self, slot: int, num_tokens: int) -> torch.Tensor:
        view = self._slot(slot, num_tokens)
        return view if self.device.type == "cpu" else view.to(self.device)

    def release(self, slot: int) -> None:
        pass  # a CUDA consumer's read copied the slot up before the work using it was queued

    def close(self) -> None:
        self._slots = None


class FramedDescriptors:
    """The producer's descriptor channel on a tcp edge (a PushChannel with the boundary)."""

    def __init__(self, sock: zmq.Socket, ring: TcpSlotRing) -> None:
        self.socket = sock
        self.ring = ring
        self._encoder = msgspec.msgpack.Encoder()

    def send(self, descriptor: BatchDescriptor) -> None:
        head = self._encoder.encode(descriptor)
        if descriptor.rows:
            self.socket.send_multipart([head, self.ring.frame(descriptor.slot)], copy=False)
        else:
            self.socket.send(head, copy=False)


class FramedIntake:
    """The consumer's descriptor channel on a tcp edge: what a PullChannel[BatchDescriptor]
    is to UpstreamIntake, except that anything malformed fails the stage (``EdgeError``)."""

    def __init__(self, sock: zmq.Socket, ring: TcpSlotRing) -> None:
        self.socket = sock
        self.ring = ring
        self._decoder: Decoder[BatchDescriptor] = Decoder(BatchDescriptor)

    def drain(self) -> list[BatchDescriptor]:
        out = []
        for parts in waiting(self.socket, multipart=True, copy=False):
            out.append(self._take(parts))
        return out

    def _take(self, parts: list[zmq.Frame]) -> BatchDescriptor:
        try:
            descriptor = self._decoder.decode(parts[0].buffer)
        except Malformed as exc:
            raise EdgeError(f"edge {self.ring.spec.name}: a descriptor that does not decode: {exc}") from None
        frames = 2 if descriptor.rows else 1
        if len(parts) != frames:
            raise EdgeError(
                f"edge {self.ring.spec.name}: batch {descriptor.batch_id} came in {len(parts)} frames, not {frames}"
            )
        if descriptor.rows:
            try:
                self.ring.fill(descriptor.slot, descriptor.num_tokens, parts[1].buffer)
            except KvasirError as exc:  # SlotError from the slot check
                raise EdgeError(str(exc)) from None
        return descriptor

    def drop(self, why: str) -> None:
        """UpstreamIntake found a descriptor that does not fit the edge: on a network edge that fails the stage."""
        raise EdgeError(f"edge {self.ring.spec.name}: {why}")
