"""A ring's head: where its batches come from (the scheduler), and what it does with
what comes back. One class per kind of ring, chosen once when the stage is built:

- ``SchedulerIntake``: a colocated ring; requests come from the bridge and run to the end.
- ``PrefillHeadIntake``: the prefill pool; a request leaves the ring after its first
  token: it is parked (its blocks held) while the tail hands it to the decode head; its blocks
  are freed when the decode head confirms every decode stage holds its KV. Waiting for
  decode blocks is back-pressure and may take as long as it takes; once the decode
  head has placed the request, a lease bounds the copy (a lost confirmation fails the
  request and frees the blocks instead of leaking them).
- ``DecodeHeadIntake`` (kvasir/stage/decode_head.py): the decode pool; requests come
  from the prefill tail, get blocks, are placed on every decode stage, and are scheduled
  once every decode stage holds its part of the KV.

With a KV pool, a head also waits for its stages' word on the pool blocks a request reads
back (``LoadWaits``, kvasir/stage/pooling.py) before scheduling it.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict

import msgspec
import torch

from kvasir.errors import BatchError, RequestError
from kvasir.recent import Recent
from kvasir.sched.scheduler import Emitted, Scheduler
from kvasir.stage.pooling import LoadWaits
from kvasir.transport.channels import PullChannel, PushChannel
from kvasir.wire.batch import BatchDescriptor
from kvasir.wire.bridge import RequestEnded, Retired
from kvasir.wire.head import (
    Adopted,
    BatchResult,
    CancelRequest,
    Enqueue,
    KvDrop,
    KvPlaced,
    PoolLoaded,
    Retire,
)
from kvasir.wire.stats import DraftCounters, HeadQueue, PrefixCounters

Work = tuple[BatchDescriptor, torch.Tensor | None]  # None: a descriptor with no rows (releases, spills, loads)


ENDED_KEPT = 65536  # ids a head remembers ending before it heard of them


def answer_load(loads: LoadWaits | None, scheduler: Scheduler, message: PoolLoaded) -> None:
    """One stage's word on a loading request's pool blocks; once every stage's is in, the
    scheduler knows where its computing starts."""
    tiers = loads.answer(message) if loads is not None else None
    if tiers is not None:
        scheduler.loaded(message.request_id, list(tiers))


class SchedulerIntake:
    """The head of a colocated ring: batches come from its scheduler.

    A cancel for a request the head has not heard of is remembered, so that the request
    is never run if its Enqueue comes after all (cancels always win).
    """

    def __init__(
        self, scheduler: Scheduler, inbox: PullChannel, bridge: PushChannel, loads: LoadWaits | None = None
    ) -> None:
        """``loads``: a plan with [kv_pool]: the wait for its stages' pool loads."""
        self.scheduler = scheduler
        self.inbox = inbox
        self.bridge = bridge
        self.loads = loads
        self.sockets = [inbox.socket]
        self.hop_ns = 0
        self.cancelled_early = Recent[int](ENDED_KEPT)
        self.retiring: Retire | None = None  # its instance is moving: answer once it holds nothing

    def receive(self) -> None:
        for message in self.inbox.drain():
            self.handle(message)
        if self.loads is not None and len(self.loads):
            for rid in self.loads.expired(time.monotonic()):
                self.scheduler.loaded(rid, [])  # its stages were too slow: it computes its prefix
        if self.retiring is not None and self.idle():
            self.bridge.send(Retired(self.retiring.index, os.getpid()))
            self.retiring = None

    def idle(self) -> bool:
        """No request here: none waiting, running, in flight, handed on or on its way."""
        queue = self.queue()
        return self.scheduler.idle and not queue.waiting and not queue.handing_off

    def pool_loaded(self, message: PoolLoaded) -> None:
        """A stage read back (some of) a loading request's pool blocks."""
        answer_load(self.loads, self.scheduler, message)

    def handle(self, message) -> None:
        match message:
            case Enqueue(request_id=rid) if self.cancelled_early.take(rid):
                self.bridge.send(RequestEnded(rid, "cancelled"))
            case Enqueue(request_id=rid, token_ids=ids, sampling=sampling, client=client, cache_root=root):
                pooled = message.pooled if self.loads is not None else 0
                try:
                    self.scheduler.submit(
                        list(ids),
                        sampling,
                        request_id=rid,
                        client=client,
                        cache_root=root,
                        pooled=pooled,
                        peers=message.peers,
                    )
                except RequestError as exc:
                    self.bridge.send(RequestEnded(rid, exc.code, exc.message))
            case PoolLoaded():
                self.pool_loaded(message)
            case Retire():
                self.retiring = message
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
        work: Work | None = None
        if room:
            batch = self.scheduler.next_batch()
            if batch is not None:
                work = batch.descriptor, batch.token_ids
        if work is None:
            release = self.scheduler.release_only()
            work = (release, None) if release is not None else None
        if work is not None and work[0].load and self.loads is not None:
            now = time.monotonic()
            for load in work[0].load:
                self.loads.expect(load.request_id, now)
        return work

    def consumed(self, descriptor: BatchDescriptor) -> None:
        pass

    def queue(self) -> HeadQueue:
        return HeadQueue(inflight=len(self.scheduler.inflight), waiting=len(self.scheduler.waiting))

    def prefix_events(self) -> tuple[list[bytes], list[bytes], bool] | None:
        return self.scheduler.cache.take_events()

    def drafts(self) -> DraftCounters | None:
        speculation = self.scheduler.speculation
        return speculation.counters() if speculation is not None else None

    def prefix(self) -> PrefixCounters | None:
        cache = self.scheduler.cache
        return PrefixCounters(
            queries=cache.queries,
            prompt_tokens=cache.query_tokens,
            hit_tokens=cache.hit_tokens,
            cached_blocks=cache.cached_blocks,
            evicted=cache.evicted,
            pooled_tokens=cache.pooled_tokens,
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
