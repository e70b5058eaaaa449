"""Events on their way to clients, bounded per client in events and in bytes.

ZMQ bounds a peer's queue in messages only, and a message may be 60 bytes (a token) or
hundreds of KiB (a stats reply with a timeline): a client that asks and never reads
could make its queue hold gigabytes. So the bridge's ROUTER keeps ZMQ's own queue per
client short (``ZMQ_QUEUE`` messages) and what does not fit waits here, counted. A
client whose backlog passes ``max_events`` or ``max_bytes`` is not reading: its backlog
is dropped, the bridge is told (it cancels the client's requests), and until ZMQ takes a
message for it again its events are dropped at once instead of queued.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

import zmq

from kvasir.bridge.ledger import Peer
from kvasir.recent import Recent

ZMQ_QUEUE = 64  # messages ZMQ holds per client before the backlog here takes over
RETRY_S = 0.002  # how often a backlog is offered to ZMQ again while clients are behind
LOST_KEPT = 4096  # lost clients remembered (their events dropped) until one reads again


class Outbox:
    def __init__(self, max_events: int, max_bytes: int, on_lost: Callable[[Peer, str], None]) -> None:
        self.max_events = max_events
        self.max_bytes = max_bytes
        self.on_lost = on_lost
        self._backlog: dict[Peer, deque[bytes]] = {}
        self._bytes: dict[Peer, int] = {}
        self._lost = Recent[Peer](LOST_KEPT)
        self._behind = asyncio.Event()
        self.dropped = 0  # events dropped for lost clients

    @property
    def waiting_bytes(self) -> int:
        """Bytes waiting here for every client together."""
        return sum(self._bytes.values())

    def deliver(self, peer: Peer, payload: bytes) -> None:
        """Queue one event for a client, behind whatever already waits for it."""
        backlog = self._backlog.get(peer)
        if backlog is not None:
            self._queue(peer, backlog, payload)
            return
        try:
            peer.io.send_now([peer.identity, payload])
        except zmq.Again:
            if peer in self._lost:
                self.dropped += 1
                return
            self._backlog[peer] = backlog = deque()
            self._bytes[peer] = 0
            self._queue(peer, backlog, payload)
            self._behind.set()
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            self._lose(peer, "disconnected")
        else:
            if self._lost:
                self._lost.take(peer)  # it reads again

    def _queue(self, peer: Peer, backlog: deque[bytes], payload: bytes) -> None:
        backlog.append(payload)
        self._bytes[peer] += len(payload)
        if len(backlog) > self.max_events or self._bytes[peer] > self.max_bytes:
            self._lose(peer, f"stopped reading its events ({len(backlog)} events, {self._bytes[peer]} bytes waiting)")

    def _lose(self, peer: Peer, why: str) -> None:
        self._backlog.pop(peer, None)
        self._bytes.pop(peer, None)
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
                peer.io.send_now([peer.identity, backlog[0]])
                self._bytes[peer] -= len(backlog.popleft())
        except zmq.Again:
            return
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            self._lose(peer, "disconnected")
            return
        del self._backlog[peer], self._bytes[peer]
