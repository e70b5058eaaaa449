"""Where a stage's outputs go: the next stage's slots (DownstreamOutlet), or the tail's
sampler, whose tokens go to the bridge and the head (TailOutlet; PrefillTailOutlet hands
prefilled requests to the decode pool)."""

from __future__ import annotations

import time
from collections import deque

import msgspec
import torch
import zmq

from kvasir.ring.slots import SlotCredits, SlotError, SlotRing
from kvasir.stage.handoff import DecodeRoutes
from kvasir.stage.heads import Work
from kvasir.stage.sampling import Sampler
from kvasir.transport.channels import PullChannel, PushChannel
from kvasir.wire.batch import BatchDescriptor
from kvasir.wire.bridge import TokenEvents
from kvasir.wire.head import BatchResult, Handoff
from kvasir.wire.stats import DraftCounters


# -- outputs -------------------------------------------------------------------------------
class DownstreamOutlet:
    """Writes boundaries into the next stage's slots, in order, waiting for credits."""

    def __init__(self, descriptors: PushChannel, ring: SlotRing, credits: PullChannel, slots: int) -> None:
        self.descriptors = descriptors
        self.ring = ring
        self.credit_channel = credits
        self.credits = SlotCredits(slots)
        self.sockets = [credits.socket]
        self._pending: deque[Work] = deque()
        self.hop_ns = 0

    @property
    def room(self) -> bool:
        return self.credits.available and not self._pending

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def receive(self) -> None:
        started = time.perf_counter_ns()
        credits = self.credit_channel.drain()
        for credit in credits:
            try:
                self.credits.give_back(credit.slot)
            except SlotError as exc:  # not from the consumer, which returns each slot once
                self.credit_channel.drop(str(exc))
        if credits:
            self.hop_ns += time.perf_counter_ns() - started
        self._flush()

    def emit(self, descriptor: BatchDescriptor, output: torch.Tensor | None) -> None:
        self._pending.append((descriptor, output))
        self._flush()

    def scored(self, descriptor: BatchDescriptor) -> tuple[int, ...]:
        return ()

    def drafts(self) -> DraftCounters | None:
        return None

    def _flush(self) -> None:
        while self._pending:
            descriptor, output = self._pending[0]
            if output is not None and not self.credits.available:
                return
            started = time.perf_counter_ns()
            if output is not None:
                slot = self.credits.take()
                self.ring.write(slot, output)
                descriptor = msgspec.structs.replace(descriptor, slot=slot)
            self._pending.popleft()
            self.descriptors.send(descriptor)
            self.hop_ns += time.perf_counter_ns() - started


class TailOutlet:
    """Samples, sends the tokens back to the head and the token events to the bridge."""

    def __init__(self, sampler: Sampler, head: PushChannel, bridge: PushChannel) -> None:
        self.sampler = sampler
        self.head = head
        self.bridge = bridge
        self.sockets: list[zmq.Socket] = []

    room = True
    pending = False
    hop_ns = 0  # sampled tokens going back to the head are not a boundary hand-off

    def receive(self) -> None:
        pass

    def scored(self, descriptor: BatchDescriptor) -> tuple[int, ...]:
        return self.sampler.scored(descriptor)

    def drafts(self) -> DraftCounters | None:
        return self.sampler.drafts()

    def emit(self, descriptor: BatchDescriptor, output: torch.Tensor | None) -> None:
        if output is None:
            self.sampler.sample(descriptor, torch.empty(0, 0))
            return
        result = self.sampler.sample(descriptor, output)
        self.sampled(descriptor, result)
        self.head.send(result)
        prompt = self.sampler.take_prompt_scores()
        if result.tokens or prompt:
            self.bridge.send(TokenEvents(result.tokens, prompt))

    def sampled(self, descriptor: BatchDescriptor, result: BatchResult) -> None:
        """Called with each batch's tokens before they go out (the prefill tail hands requests on)."""


class PrefillTailOutlet(TailOutlet):
    """The prefill pool's tail: as a tail, and every request whose first token is not its
    last goes straight to the decode head (its KV is already on its way)."""

    def __init__(
        self, sampler: Sampler, head: PushChannel, bridge: PushChannel, decode_heads: dict[int, PushChannel], first: int
    ) -> None:
        """``decode_heads``: every decode instance's head by its global index; ``first``:
        this prefill instance's head's."""
        super().__init__(sampler, head, bridge)
        self.decode_heads = decode_heads
        self.first = first
        self.routes = DecodeRoutes(sorted(decode_heads))

    def emit(self, descriptor: BatchDescriptor, output: torch.Tensor | None) -> None:
        self.routes.learn(descriptor)
        super().emit(descriptor, output)

    def sampled(self, descriptor: BatchDescriptor, result: BatchResult) -> None:
        lengths = {row.request_id: row.start + row.num_tokens for row in descriptor.rows if row.emit}
        now = time.monotonic_ns()
        for token in result.tokens:
            head = self.routes.take(token.request_id)  # its prompt is done: handed on, or finished here
            if token.finish is None:
                sampling, seed, prompt = self.sampler.spec(token.request_id)
                handoff = Handoff(
                    token.request_id, lengths[token.request_id], token.token_id, sampling, seed, now, self.first, prompt
                )
                self.decode_heads[head].send(handoff)
