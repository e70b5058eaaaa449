"""A ring's head: where its batches come from (the scheduler), and what it does with
what comes back. One class per kind of ring, chosen once when the stage is built:

- ``SchedulerIntake``: a colocated ring; requests come from the bridge and run to the end.
- ``PrefillHeadIntake``: the prefill pool; a request leaves the ring after its first
  token: it is parked (its blocks held) while the tail hands it to the decode head; its blocks
  are freed when the decode head confirms every decode stage holds its KV. Waiting for
  decode blocks is back-pressure and may take as long as it takes; once the decode
  head has placed the request, a lease bounds the copy (a lost confirmation fails the
  request and frees the blocks instead of leaking them).
- ``DecodeHeadIntake``: the decode pool; requests come from the prefill tail, get blocks
  (or wait for them: back-pressure on the prefill pool), are placed on every decode
  stage, and are scheduled once every decode stage holds its part of the KV.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

import msgspec
import torch

from kvasir.errors import BatchError, RequestError
from kvasir.recent import Recent
from kvasir.sched.scheduler import Emitted, Scheduler
from kvasir.transport.channels import PullChannel, PushChannel
from kvasir.wire.batch import BatchDescriptor
from kvasir.wire.bridge import HandoffReport, RequestEnded
from kvasir.wire.head import Adopted, BatchResult, CancelRequest, Enqueue, Handoff, KvDrop, KvHeld, KvPlaced
from kvasir.wire.kv import Placement
from kvasir.wire.stats import HeadQueue, PrefixCounters

Work = tuple[BatchDescriptor, torch.Tensor | None]  # None: a release-only descriptor


ENDED_KEPT = 65536  # ids a head remembers ending before it heard of them


class SchedulerIntake:
    """The head of a colocated ring: batches come from its scheduler.

    A cancel for a request the head has not heard of is remembered, so that the request
    is never run if its Enqueue comes after all (cancels always win).
    """

    def __init__(self, scheduler: Scheduler, inbox: PullChannel, bridge: PushChannel) -> None:
        self.scheduler = scheduler
        self.inbox = inbox
        self.bridge = bridge
        self.sockets = [inbox.socket]
        self.hop_ns = 0
        self.cancelled_early = Recent[int](ENDED_KEPT)

    def receive(self) -> None:
        for message in self.inbox.drain():
            self.handle(message)

    def handle(self, message) -> None:
        match message:
            case Enqueue(request_id=rid) if self.cancelled_early.take(rid):
                self.bridge.send(RequestEnded(rid, "cancelled"))
            case Enqueue(request_id=rid, token_ids=ids, sampling=sampling, client=client, cache_root=root):
                try:
                    self.scheduler.submit(list(ids), sampling, request_id=rid, client=client, cache_root=root)
                except RequestError as exc:
                    self.bridge.send(RequestEnded(rid, exc.code, exc.message))
            case CancelRequest(request_id=rid) if not self._known(rid):
                self.cancelled_early.add(rid)
            case CancelRequest(request_id=rid):
                self.report(self.scheduler.cancel(rid))
            case BatchResult(batch_id=batch) if batch not in self.scheduler.inflight:
                self.inbox.drop(f"result for batch {batch}, which is not in flight")
            case BatchResult():
                try:
                    events = self.scheduler.complete(message)
                except BatchError as exc:
                    self.inbox.drop(str(exc))
                    return
                for event in events:
                    self.report(event)

    def _known(self, rid: int) -> bool:
        return rid in self.scheduler.waiting or rid in self.scheduler.running

    def report(self, event: Emitted | None) -> None:
        if event is not None and event.finish == "cancelled":
            self.bridge.send(RequestEnded(event.request_id, "cancelled"))

    def take(self, room: bool) -> Work | None:
        if room:
            batch = self.scheduler.next_batch()
            if batch is not None:
                return batch.descriptor, batch.token_ids
        release = self.scheduler.release_only()
        return (release, None) if release is not None else None

    def consumed(self, descriptor: BatchDescriptor) -> None:
        pass

    def queue(self) -> HeadQueue:
        return HeadQueue(inflight=len(self.scheduler.inflight), waiting=len(self.scheduler.waiting))

    def prefix_events(self) -> tuple[list[bytes], list[bytes], bool] | None:
        return self.scheduler.cache.take_events()

    def prefix(self) -> PrefixCounters | None:
        cache = self.scheduler.cache
        return PrefixCounters(
            queries=cache.queries,
            prompt_tokens=cache.query_tokens,
            hit_tokens=cache.hit_tokens,
            cached_blocks=cache.cached_blocks,
            evicted=cache.evicted,
        )


class PrefillHeadIntake(SchedulerIntake):
    """The prefill pool's head. Its tail hands each request to the decode head itself (no
    wait for this loop); the head parks the request, holding its blocks, until adopted."""

    def __init__(
        self,
        scheduler: Scheduler,
        inbox: PullChannel,
        bridge: PushChannel,
        decode_heads: dict[int, PushChannel],
        lease_s: float,
    ) -> None:
        """``decode_heads``: every decode instance's head, by its global index; each
        request goes on to the one its Enqueue names."""
        super().__init__(scheduler, inbox, bridge)
        self.decode_heads = decode_heads
        self.routes: OrderedDict[int, int] = OrderedDict()  # request -> its decode head (the recent ones)
        self.lease_s = lease_s
        self.handed: set[int] = set()  # parked: handed off, not yet adopted
        self.leases: OrderedDict[int, float] = OrderedDict()  # of those, placed by the decode head: since when
        self.early: dict[
            int, float | None
        ] = {}  # the decode head's word that overtook the tail's result: placed at, or None: adopted

    def receive(self) -> None:
        super().receive()
        self._expire(time.monotonic())

    def handle(self, message) -> None:
        scheduler = self.scheduler
        match message:
            case Enqueue(request_id=rid, decode_head=head) if not self._route(rid, head):
                self.bridge.send(
                    RequestEnded(rid, "internal_error", f"no decode instance has its head at stage {head}")
                )
            case CancelRequest(request_id=rid) if rid in self.handed:
                self._to_decode(rid, message)  # handed off: the decode head ends it
            case CancelRequest(request_id=rid) if not self._known(rid):
                self.cancelled_early.add(rid)  # not here yet, or already adopted: the decode head ends it
                self._to_decode(rid, message)
            case BatchResult(batch_id=batch) if batch not in scheduler.inflight:
                self.inbox.drop(f"result for batch {batch}, which is not in flight")
            case BatchResult():
                members = scheduler.inflight.get(message.batch_id, ())
                prompt_done = {rid for rid in members if self._prompt_ran(rid)}
                for event in scheduler.complete(message):
                    self.report(event)
                    if event.finish is None and event.token_id is not None:
                        self._park(event.request_id)
                    elif event.request_id in prompt_done:  # its KV was announced to the decode stages
                        self.early.pop(event.request_id, None)
                        self._to_decode(event.request_id, KvDrop(event.request_id))
            case KvPlaced(request_id=rid) if rid in self.handed:
                self.leases[rid] = time.monotonic()
            case Adopted(request_id=rid) if rid in self.handed:
                self.handed.discard(rid)
                self.leases.pop(rid, None)
                scheduler.retire(rid)
            case KvPlaced(request_id=rid) | Adopted(request_id=rid) if rid in scheduler.running:
                self.early[rid] = time.monotonic() if isinstance(message, KvPlaced) else None
            case KvPlaced() | Adopted():
                pass  # the request ended here first (cancelled, or its lease ran out)
            case _:
                super().handle(message)

    def _route(self, rid: int, head: int) -> bool:
        """Remember which decode instance a request goes on to (-1: the only one); False
        when no decode instance has that head."""
        if head == -1 and len(self.decode_heads) == 1:
            head = next(iter(self.decode_heads))
        if head not in self.decode_heads:
            return False
        self.routes[rid] = head
        if len(self.routes) > ENDED_KEPT:
            self.routes.popitem(last=False)
        return True  # the base class admits it (the next case)

    def _to_decode(self, rid: int, message) -> None:
        """Send to the request's decode head; one this head no longer knows: to every one
        (a decode head drops what it never heard of)."""
        head = self.routes.get(rid)
        for index, channel in self.decode_heads.items():
            if head is None or index == head:
                channel.send(message)

    def take(self, room: bool) -> Work | None:
        """As a head's, with each new request's decode instance in its descriptor (the
        prefill stages and the tail hand its KV and first token there)."""
        work = super().take(room)
        if work is None or not work[0].new_requests:
            return work
        descriptor, tokens = work
        routed = tuple(
            msgspec.structs.replace(new, decode_head=self.routes.get(new.request_id, -1))
            for new in descriptor.new_requests
        )
        return msgspec.structs.replace(descriptor, new_requests=routed), tokens

    def _prompt_ran(self, rid: int) -> bool:
        """Its last prompt chunk has run: the prefill stages announced its KV."""
        state = self.scheduler.running.get(rid)
        return state is not None and state.computed >= state.prompt_len

    def _park(self, rid: int) -> None:
        placed = self.early.pop(rid, 0.0)
        if placed is None:  # adopted before its first token's result came back here
            self.scheduler.retire(rid)
            return
        self.scheduler.park(rid)
        self.handed.add(rid)
        if placed:
            self.leases[rid] = placed

    def _expire(self, now: float) -> None:
        while self.leases:
            rid, since = next(iter(self.leases.items()))
            if now - since < self.lease_s:
                return
            del self.leases[rid]
            self.handed.discard(rid)
            self.scheduler.retire(rid)
            self._to_decode(rid, KvDrop(rid))  # this head tells the bridge; the decode head drops it quietly
            self.bridge.send(
                RequestEnded(
                    rid, "stage_failed", f"the decode pool did not take the request's KV within {self.lease_s:g} s"
                )
            )

    def queue(self) -> HeadQueue:
        return msgspec.structs.replace(super().queue(), handing_off=len(self.handed))


@dataclass
class Placed:
    """A request placed on the decode stages, waiting for each to hold its KV."""

    ready_ns: int  # when the prefill tail handed it over
    held: set[int]
    nbytes: int = 0
    copy_ns: int = 0  # the slowest stage's copy
    last_ns: int = 0


class DecodeHeadIntake(SchedulerIntake):
    def __init__(
        self,
        scheduler: Scheduler,
        inbox: PullChannel,
        bridge: PushChannel,
        prefill_heads: dict[int, PushChannel],
        stages: list[PushChannel],
    ) -> None:
        """``prefill_heads``: every prefill instance's head, by its global index (each
        hand-off names the one it came from); ``stages``: this instance's stages' KV inboxes."""
        super().__init__(scheduler, inbox, bridge)
        self.prefill_heads = prefill_heads
        self.stages = stages  # every decode stage's KV inbox, this one's included
        self.sources: dict[int, int] = {}  # pending and placed requests: their prefill head
        self.pending: OrderedDict[int, Handoff] = OrderedDict()  # waiting for blocks
        self.placed: dict[int, Placed] = {}
        self.ended = Recent[int](ENDED_KEPT)  # cancelled or dropped before their hand-off arrived
        self.quiet = Recent[int](ENDED_KEPT)  # dropped by the prefill head, which tells the bridge itself

    def receive(self) -> None:
        super().receive()
        self._place()

    def handle(self, message) -> None:
        match message:
            case Handoff(prefill_head=head) if head not in self.prefill_heads:
                self.inbox.drop(f"hand-off from stage {head}, which is no prefill instance's head")
            case Handoff(request_id=rid) if self.ended.take(rid):
                self.sources[rid] = message.prefill_head
                self._drop(rid)  # a cancel or drop from the prefill head overtook it
            case Handoff(request_id=rid):  # timed on this head's clock (the prefill pool may be on another host)
                self.sources[rid] = message.prefill_head
                self.pending[rid] = msgspec.structs.replace(message, ready_ns=time.monotonic_ns())
            case KvHeld(request_id=rid) if rid in self.placed:
                self._held(message)
            case KvHeld():
                pass  # a request that ended while its KV was being copied
            case KvDrop(request_id=rid):
                self.quiet.add(rid)  # its end reached the bridge from the prefill pool: one word per request
                self._end(rid)
            case CancelRequest(request_id=rid):
                self._end(rid)
            case _:
                super().handle(message)

    def _end(self, rid: int) -> None:
        """Cancel (or drop) a request wherever it is on this side."""
        if rid in self.pending or rid in self.placed:
            if self.pending.pop(rid, None) is None:
                del self.placed[rid]
                self.scheduler.retire(rid)
            self._drop(rid)
        elif rid in self.scheduler.running:
            self.report(self.scheduler.cancel(rid))
        else:
            self._broadcast(Placement(rid, ()))  # its parts may have reached the stages
            self.ended.add(rid)

    def _to_prefill(self, rid: int, message) -> None:
        """Tell the prefill head a request came from (it is forgotten with its last word)."""
        head = self.sources.get(rid)
        if head is not None:
            self.prefill_heads[head].send(message)

    def _drop(self, rid: int) -> None:
        self._broadcast(Placement(rid, ()))
        self._to_prefill(rid, Adopted(rid))  # the prefill pool may free the blocks
        self.sources.pop(rid, None)
        if not self.quiet.take(rid):
            self.bridge.send(RequestEnded(rid, "cancelled"))

    def report(self, event: Emitted | None) -> None:
        if event is not None and event.finish == "cancelled" and self.quiet.take(event.request_id):
            return  # dropped for the prefill pool, which told the bridge how it ended
        super().report(event)

    def _place(self) -> None:
        """Reserve blocks for waiting hand-offs, oldest first, while the cache has room."""
        while self.pending:
            handoff = next(iter(self.pending.values()))
            blocks = self.scheduler.reserve(
                handoff.request_id,
                handoff.prompt_len,
                [handoff.first_token],
                handoff.sampling,
                handoff.seed,
                handoff.prompt,
            )
            if blocks is None:
                return  # the decode pool is full: the prefill pool keeps holding the KV
            del self.pending[handoff.request_id]
            self.placed[handoff.request_id] = Placed(handoff.ready_ns, set())
            self._broadcast(Placement(handoff.request_id, tuple(blocks), handoff.prefill_head))
            self._to_prefill(handoff.request_id, KvPlaced(handoff.request_id))

    def _held(self, held: KvHeld) -> None:
        placed = self.placed[held.request_id]
        placed.held.add(held.stage)
        placed.nbytes += held.nbytes
        placed.copy_ns = max(placed.copy_ns, held.copy_ns)
        placed.last_ns = time.monotonic_ns()  # when this head heard it (the stages may be on other hosts)
        if len(placed.held) < len(self.stages):
            return
        rid = held.request_id
        del self.placed[rid]
        self.scheduler.unpark(rid)
        self._to_prefill(rid, Adopted(rid))
        self.sources.pop(rid, None)
        self.bridge.send(
            HandoffReport(rid, placed.nbytes, (placed.last_ns - placed.ready_ns) / 1e9, placed.copy_ns / 1e9)
        )

    def _broadcast(self, message: Placement) -> None:
        for stage in self.stages:
            stage.send(message)

    def queue(self) -> HeadQueue:
        queue = super().queue()  # and the requests whose KV is on its way
        return msgspec.structs.replace(queue, waiting=queue.waiting + len(self.pending) + len(self.placed))
