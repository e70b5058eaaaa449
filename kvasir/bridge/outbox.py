"""Events on their way to clients, bounded per client in events and in bytes.

ZMQ bounds a peer's queue in messages only, and a message may be 60 bytes (a token) or
hundreds of KiB (a stats reply with a timeline): a client that asks and never reads
could make its queue hold gigabytes. So the bridge's ROUTER keeps ZMQ's own queue per
client short (``ZMQ_QUEUE`` messages) and what does not fit waits here, counted. A
client whose backlog passes ``max_events`` or ``max_bytes`` is not reading: its backlog
is dropped, the bridge is told (it cancels the client's requests), and until ZMQ takes a
message for it again its events are dropped at once instead of queued.

Events for one client that arise in the same turn of the event loop (the answers to a
batch of submissions, the tokens of one batch) leave as one ZMQ message, a batch of up
to MAX_BATCH events and BATCH_BYTES (an event larger than that goes alone), so ZMQ's
queue of ZMQ_QUEUE messages stays as small as before (kvasir/transport/envelopes.py); the
bounds here count events all the same.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

import zmq

from kvasir.bridge.ledger import Peer
from kvasir.recent import Recent
from kvasir.transport.envelopes import MAX_BATCH, join

ZMQ_QUEUE = 64  # messages ZMQ holds per client before the backlog here takes over
RETRY_S = 0.002  # how often a backlog is offered to ZMQ again while clients are behind
LOST_KEPT = 4096  # lost clients remembered (their events dropped) until one reads again
BATCH_BYTES = 64 * 1024  # events joined into one message up to this size (ZMQ bounds messages, not bytes)


class Outbox:
    def __init__(self, max_events: int, max_bytes: int, on_lost: Callable[[Peer, str], None]) -> None:
        self.max_events = max_events
        self.max_bytes = max_bytes
        self.on_lost = on_lost
        self._backlog: dict[Peer, deque[tuple[bytes, int]]] = {}  # (message, events in it)
        self._bytes: dict[Peer, int] = {}
        self._events: dict[Peer, int] = {}
        self._lost = Recent[Peer](LOST_KEPT)
        self._behind = asyncio.Event()
        self._turn: dict[Peer, list[bytes]] = {}  # events of this loop turn, sent together at its end
        self._turn_bytes: dict[Peer, int] = {}
        self._after: list[Callable[[], None]] = []  # run once this turn's events are handed to ZMQ
        self._ending = False  # end_turn is scheduled
        self.dropped = 0  # events dropped for lost clients

    @property
    def waiting_bytes(self) -> int:
        """Bytes waiting here for every client together."""
        return sum(self._bytes.values())

    def deliver(self, peer: Peer, payload: bytes) -> None:
        """Queue one event for a client, behind whatever already waits for it; it leaves
        when this turn of the event loop ends, with the client's other events of the turn
        (a lost client's is offered to ZMQ at once, and dropped if ZMQ has no room)."""
        if peer in self._lost:
            self._send(peer, payload, 1)
            return
        self._schedule()
        held = self._turn.get(peer)
        if held is not None and (len(held) == MAX_BATCH or self._turn_bytes[peer] + len(payload) > BATCH_BYTES):
            self._send(peer, join(held), len(held))
            held = None
        if held is None:
            self._turn[peer] = held = []
            self._turn_bytes[peer] = 0
        held.append(payload)
        self._turn_bytes[peer] += len(payload)

    def after_turn(self, action: Callable[[], None]) -> None:
        """Run ``action`` once the events of this turn have been handed to ZMQ (or queued
        here), and a client that turned out to be gone has been lost."""
        self._schedule()
        self._after.append(action)

    def _schedule(self) -> None:
        if not self._ending:
            self._ending = True
            asyncio.get_running_loop().call_soon(self.end_turn)

    def end_turn(self) -> None:
        self._ending = False
        turn, self._turn, self._turn_bytes = self._turn, {}, {}
        for peer, payloads in turn.items():
            self._send(peer, join(payloads), len(payloads))
        after, self._after = self._after, []
        for action in after:
            action()

    def _send(self, peer: Peer, payload: bytes, events: int) -> None:
        backlog = self._backlog.get(peer)
        if backlog is not None:
            self._queue(peer, backlog, payload, events)
            return
        try:
            peer.io.send_now([peer.identity, payload])
        except zmq.Again:
            if peer in self._lost:
                self.dropped += events
                return
            self._backlog[peer] = backlog = deque()
            self._bytes[peer] = self._events[peer] = 0
            self._queue(peer, backlog, payload, events)
            self._behind.set()
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            if peer in self._lost:
                self.dropped += events  # told once already
            else:
                self._lose(peer, "disconnected")
        else:
            if self._lost:
                self._lost.take(peer)  # it reads again

    def _queue(self, peer: Peer, backlog: deque[tuple[bytes, int]], payload: bytes, events: int) -> None:
        backlog.append((payload, events))
        self._bytes[peer] += len(payload)
        self._events[peer] += events
        if self._events[peer] > self.max_events or self._bytes[peer] > self.max_bytes:
            waiting = f"{self._events[peer]} events, {self._bytes[peer]} bytes waiting"
            self._lose(peer, f"stopped reading its events ({waiting})")

    def _lose(self, peer: Peer, why: str) -> None:
        self._backlog.pop(peer, None)
        self._bytes.pop(peer, None)
        self._events.pop(peer, None)
        self._lost.add(peer)
        self.on_lost(peer, why)

    async def run(self) -> None:
        """Offer every backlog to ZMQ again, oldest event first, while any client is behind."""
        while True:
            await self._behind.wait()
            for peer in list(self._backlog):
                self._flush(peer)
            if self._backlog:
                await asyncio.sleep(RETRY_S)
            else:
                self._behind.clear()

    def _flush(self, peer: Peer) -> None:
        backlog = self._backlog[peer]
        try:
            while backlog:
                peer.io.send_now([peer.identity, backlog[0][0]])
                payload, events = backlog.popleft()
                self._bytes[peer] -= len(payload)
                self._events[peer] -= events
        except zmq.Again:
            return
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            self._lose(peer, "disconnected")
            return
        del self._backlog[peer], self._bytes[peer], self._events[peer]
