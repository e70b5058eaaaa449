"""A stage's expert shards, seen from the stage: each ``RemoteShard`` writes its rows into
the shard's dispatch slot and sends the work; the results come back on one socket for
all of the stage's shards (``ShardResults``).

While it waits the stage keeps beating (``Pulse``), so a shard that hangs is the one the
launcher finds silent and names; a wait longer than twice the heartbeat timeout (a shard
that is alive but dropped the work) fails the stage."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from kvasir.errors import KvasirError
from kvasir.ring.expert_slots import DispatchSegment
from kvasir.ring.shm import SlotError
from kvasir.ring.tcp_slots import EdgeError
from kvasir.transport.channels import PullChannel, PushChannel
from kvasir.wire.control import Heartbeat, ShardWiring
from kvasir.wire.experts import ExpertDone, ExpertWork

WAIT_POLL_MS = 100


class ShardLost(KvasirError):
    """A shard did not answer a dispatch within the stage's wait bound."""


class Pulse:
    """Sends the stage's heartbeat when one is due (called while it waits for shards)."""

    def __init__(self, control: PushChannel, heartbeat: Heartbeat, interval_s: float) -> None:
        self.control = control
        self.heartbeat = heartbeat
        self.interval_s = interval_s
        self._next = 0.0

    def __call__(self) -> None:
        now = time.monotonic()
        if now >= self._next:
            self._next = now + self.interval_s
            self.control.send(self.heartbeat)


class ShardResults:
    """The stage's PULL socket for its shards' ``ExpertDone``. Only the answer to each
    shard's outstanding dispatch is kept: anything else (a stray or replayed result) is
    dropped, so it can neither stand in for nor displace the answer awaited."""

    def __init__(self, inbox: PullChannel, pulse: Callable[[], None], wait_s: float) -> None:
        self.inbox = inbox
        self.pulse = pulse  # heartbeats while waiting
        self.wait_s = wait_s
        self.awaited: dict[int, int] = {}  # shard number -> the seq of its outstanding dispatch
        self.done: dict[int, ExpertDone] = {}
        self.slots: dict[int, DispatchSegment] = {}  # shard number -> its slot (filled here on a tcp one)

    def expect(self, shard: int, seq: int) -> None:
        self.awaited[shard] = seq

    def wait(self, shard: int, seq: int) -> ExpertDone:
        deadline = time.monotonic() + self.wait_s
        while True:
            for message, frames in self.inbox.drain_framed():
                if isinstance(message, ExpertDone) and self.awaited.get(message.shard) == message.seq:
                    self._take(message, frames)
                else:
                    self.inbox.drop(f"{message!r} answers no outstanding dispatch")
            done = self.done.pop(shard, None)
            if done is not None:
                return done
            if time.monotonic() > deadline:
                raise ShardLost(f"shard-{shard} did not answer dispatch {seq} within {self.wait_s:g} s")
            self.pulse()
            self.inbox.socket.poll(WAIT_POLL_MS)

    def _take(self, done: ExpertDone, frames: list) -> None:
        """An awaited answer; from a shard on another host its partial sums come with it."""
        slot = self.slots.get(done.shard)
        if slot is not None and slot.spec.kind == "tcp":
            try:
                slot.fill_out(done.rows, [frame.buffer for frame in frames])
            except SlotError as exc:
                raise EdgeError(f"shard-{done.shard}: {exc}") from None
        elif frames:
            self.inbox.drop(f"shard-{done.shard} sent frames with its answer through shared memory")
            return
        self.done[done.shard] = done
        del self.awaited[done.shard]


class RemoteShard:
    """An ``ExpertShard`` (kvasir/model/expert_dispatch.py) in its own process."""

    def __init__(
        self, wiring: ShardWiring, slot: DispatchSegment, work: PushChannel, results: ShardResults, device: torch.device
    ) -> None:
        self.wiring = wiring
        self.device = device
        self.experts = wiring.experts
        self.slot = slot
        self.work = work
        self.results = results
        self.seq = 0
        self._rows = 0

    def start(self, layer: int, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> None:
        self.slot.write_rows(hidden, ids, weights)
        self.seq += 1
        self._rows = hidden.shape[0]
        self.results.expect(self.wiring.number, self.seq)
        frames = self.slot.row_frames(self._rows) if self.slot.spec.kind == "tcp" else ()
        self.work.send(ExpertWork(self.seq, layer, self._rows), frames)

    def finish(self, layer: int) -> torch.Tensor:
        done = self.results.wait(self.wiring.number, self.seq)
        if done.rows != self._rows:
            raise ShardLost(f"shard-{done.shard} answered dispatch {done.seq} with {done.rows} rows, not {self._rows}")
        return self.slot.read_out(self._rows, self.device)


def connect_shards(
    shards: list[ShardWiring],
    inbox: PullChannel,
    work: Callable[[int], PushChannel],
    pulse: Callable[[], None],
    wait_s: float,
    device: torch.device,
) -> tuple[list[RemoteShard], list[DispatchSegment]]:
    """The stage's RemoteShards (in expert order) and the slots to close at the end;
    ``work(number)`` is a PUSH channel to a shard's work socket."""
    results = ShardResults(inbox, pulse, wait_s)
    slots = [DispatchSegment(wiring.slot, create=False, side="stage") for wiring in shards]
    results.slots = {wiring.number: slot for wiring, slot in zip(shards, slots, strict=True)}
    remote = [
        RemoteShard(wiring, slot, work(wiring.number), results, device)
        for wiring, slot in zip(shards, slots, strict=True)
    ]
    return remote, slots
