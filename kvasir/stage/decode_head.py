"""A disaggregated plan's decode head (``DecodeHeadIntake``): requests come from the
prefill tail, get blocks (or wait for them: back-pressure on the prefill pool), are
placed on every decode stage, and are scheduled once every decode stage holds its part
of the KV (kvasir/stage/heads.py has the colocated and prefill heads)."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

import msgspec

from kvasir.recent import Recent
from kvasir.sched.scheduler import Emitted, Scheduler
from kvasir.stage.heads import ENDED_KEPT, SchedulerIntake
from kvasir.transport.channels import PullChannel, PushChannel
from kvasir.wire.bridge import HandoffReport, RequestEnded
from kvasir.wire.head import Adopted, CancelRequest, Handoff, KvDrop, KvHeld, KvPlaced
from kvasir.wire.kv import Placement
from kvasir.wire.stats import HeadQueue


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
