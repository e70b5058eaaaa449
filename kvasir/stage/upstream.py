"""Every stage but the head: batches arrive as descriptors naming a slot of the upstream
edge's ring, and each slot read goes back as a credit."""

from __future__ import annotations

import time
from collections import deque

from kvasir.ring.slots import SlotRing
from kvasir.stage.heads import Work
from kvasir.transport.channels import PullChannel, PushChannel
from kvasir.wire.batch import BatchDescriptor, Credit
from kvasir.wire.stats import DraftCounters, HeadQueue, PrefixCounters


# -- every other stage: batches come from upstream ----------------------------------------
class UpstreamIntake:
    def __init__(self, descriptors: PullChannel, ring: SlotRing, credits: PushChannel) -> None:
        self.descriptors = descriptors
        self.ring = ring
        self.credits = credits
        self.sockets = [descriptors.socket]
        self._queue: deque[BatchDescriptor] = deque()
        self.hop_ns = 0

    def receive(self) -> None:
        started = time.perf_counter_ns()
        arrived = self.descriptors.drain()
        if arrived:
            self._queue.extend(d for d in arrived if self._fits(d))
            self.hop_ns += time.perf_counter_ns() - started

    def _fits(self, descriptor: BatchDescriptor) -> bool:
        """A descriptor whose slot and token counts fit this edge (anything else cannot
        have come from the upstream stage: dropped, and the ring keeps its own order)."""
        spec = self.ring.spec
        total = sum(row.num_tokens for row in descriptor.rows)
        if descriptor.rows:
            fits = 0 <= descriptor.slot < spec.slots and 0 < total == descriptor.num_tokens <= spec.max_tokens
        else:
            fits = descriptor.num_tokens == 0
        if not fits:
            self.descriptors.drop(
                f"descriptor of batch {descriptor.batch_id} does not fit the edge (slot {descriptor.slot}, {descriptor.num_tokens} tokens)"
            )
        return fits

    def take(self, room: bool) -> Work | None:
        if not self._queue:
            return None
        descriptor = self._queue.popleft()
        if not descriptor.rows:
            return descriptor, None
        started = time.perf_counter_ns()
        boundary = self.ring.read(descriptor.slot, descriptor.num_tokens)
        self.hop_ns += time.perf_counter_ns() - started
        return descriptor, boundary

    def consumed(self, descriptor: BatchDescriptor) -> None:
        if descriptor.rows:
            started = time.perf_counter_ns()
            self.ring.release(descriptor.slot)
            self.credits.send(Credit(descriptor.slot))
            self.hop_ns += time.perf_counter_ns() - started

    def queue(self) -> HeadQueue | None:
        return None  # not a head

    def drafts(self) -> DraftCounters | None:
        return None

    def prefix(self) -> PrefixCounters | None:
        return None

    def prefix_events(self) -> tuple[list[bytes], list[bytes], bool] | None:
        return None
