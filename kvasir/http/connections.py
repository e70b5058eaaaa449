"""A front's connections, bounded in number and in how long they may idle.

aiohttp keeps a connection as long as its peer keeps it open and waits for a request
head without limit: a thousand sockets that never finish a request would hold a front's
descriptors. ``Connections`` wraps aiohttp's protocol factory (``web.Server``) so that:

- each connection has a deadline for its next request head: ``http.header_timeout_s``
  from its opening, ``http.idle_timeout_s`` from the end of its last response; one that
  misses it is closed (a connection inside a request has no deadline here: the request
  has its own timeouts);
- at most ``http.max_connections`` are open: a new one beyond that closes the one that has
  been waiting longest without a request, and only when every connection is inside a
  request is the newcomer answered 503 and closed.

The routes mark a connection's requests (``busy`` / ``idle``) through the middleware in
kvasir/http/api.py.
"""

from __future__ import annotations

import asyncio
import socket
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

SEND_BUFFER = 256 * 1024  # kernel send buffer of each connection (bytes a client that stops reading holds)
_FULL_BODY = (
    b'{"error":{"message":"too many connections to this server (http.max_connections)",'
    b'"type":"service_unavailable","param":null,"code":"overloaded"}}'
)
FULL = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 5\r\n"
    b"Connection: close\r\nContent-Length: " + str(len(_FULL_BODY)).encode() + b"\r\n\r\n" + _FULL_BODY
)


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int
    header_timeout_s: float
    idle_timeout_s: float


class Connections:
    def __init__(self, factory: Callable[[], asyncio.Protocol], limits: ConnectionLimits, log) -> None:
        self.factory = factory
        self.limits = limits
        self.log = log
        self.waiting: OrderedDict[Any, asyncio.TimerHandle] = OrderedDict()  # transport -> its deadline
        self.busy_ones: set[Any] = set()  # transports inside a request (aiohttp runs one at a time each)
        self.closed_idle = 0  # closed for missing a deadline
        self.evicted = 0  # closed to make room for a newer one
        self.refused = 0  # answered 503: every connection was inside a request

    @property
    def open(self) -> int:
        return len(self.waiting) + len(self.busy_ones)

    def __call__(self) -> asyncio.Protocol:
        return _Guarded(self.factory(), self)

    # -- the connection's life ---------------------------------------------------------------
    def opened(self, transport) -> bool:
        """A new connection: False when it was refused (every slot is inside a request)."""
        if self.open >= self.limits.max_connections:
            if not self.waiting:
                self.refused += 1
                transport.write(FULL)
                transport.close()
                return False
            oldest, deadline = self.waiting.popitem(last=False)
            deadline.cancel()
            self.evicted += 1
            oldest.abort()
        sock = transport.get_extra_info("socket")
        if sock is not None:  # a fixed kernel buffer: autotuning would let each connection hold 4 MiB
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
        self._wait(transport, self.limits.header_timeout_s)
        return True

    def closed(self, transport) -> None:
        deadline = self.waiting.pop(transport, None)
        if deadline is not None:
            deadline.cancel()
        self.busy_ones.discard(transport)

    def busy(self, transport) -> None:
        """A request on ``transport`` began (its head is read): no deadline while it runs."""
        if transport is None:
            return
        deadline = self.waiting.pop(transport, None)
        if deadline is not None:
            deadline.cancel()
            self.busy_ones.add(transport)

    def idle(self, transport) -> None:
        """A request on ``transport`` ended: the next head must come within the idle timeout."""
        if transport not in self.busy_ones:
            return
        self.busy_ones.remove(transport)
        if not transport.is_closing():
            self._wait(transport, self.limits.idle_timeout_s)

    def _wait(self, transport, seconds: float) -> None:
        loop = asyncio.get_running_loop()
        self.waiting[transport] = loop.call_later(seconds, self._expire, transport)

    def _expire(self, transport) -> None:
        if self.waiting.pop(transport, None) is not None:
            self.closed_idle += 1
            transport.abort()


class _Guarded(asyncio.Protocol):
    """aiohttp's protocol for one connection, with ``Connections`` told of its opening and end."""

    def __init__(self, inner: Any, connections: Connections) -> None:
        self.inner = inner
        self.connections = connections
        self.transport: Any = None

    def connection_made(self, transport) -> None:
        self.transport = transport
        if self.connections.opened(transport):
            self.inner.connection_made(transport)
        else:
            self.inner = None

    def connection_lost(self, exc: Exception | None) -> None:
        self.connections.closed(self.transport)
        if self.inner is not None:
            self.inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.inner is not None:
            self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.inner is not None else None

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()
