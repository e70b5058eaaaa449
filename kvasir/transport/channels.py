"""Socket endpoints in a runtime directory, and typed ZMQ channels for each edge.

Every endpoint is an ``ipc://`` path inside the daemon's runtime directory, so two
daemons with different runtime directories never collide. Channels encode and decode
one msgspec type (or tagged union) each; nothing is pickled.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar, cast

import msgspec
import zmq

from kvasir.errors import KvasirError
from kvasir.units import MIB
from kvasir.wire.decoding import Decoder, Malformed

if TYPE_CHECKING:
    from kvasir.transport.curve import Fabric
    from kvasir.transport.routes import Routes

T = TypeVar("T")


def default_runtime_dir() -> Path:
    """``$KVASIR_RUNTIME_DIR``, else ``$XDG_RUNTIME_DIR/kvasir``, else ``/tmp/kvasir-$UID``."""
    explicit = os.environ.get("KVASIR_RUNTIME_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return Path(xdg) / "kvasir"
    return Path(f"/tmp/kvasir-{os.getuid()}")


class Endpoints:
    """The daemon's socket paths under one runtime directory; with ``routes`` (a plan
    whose workers span hosts, kvasir/transport/routes.py) the internal sockets are TCP
    endpoints instead, and only the clients' sockets stay files."""

    def __init__(self, runtime_dir: str | Path, routes: Routes | None = None) -> None:
        self.dir = Path(runtime_dir)
        self.routes = routes

    def _ipc(self, name: str) -> str:
        return f"ipc://{self.dir / name}"

    def _internal(self, name: str) -> str:
        return self.routes.endpoint(name) if self.routes is not None else self._ipc(f"{name}.sock")

    @property
    def client(self) -> str:  # bridge ROUTER: submit, cancel, stats
        return self._ipc("client.sock")

    @property
    def client_path(self) -> Path:
        return self.dir / "client.sock"

    @property
    def events(self) -> str:  # bridge PUB: every token event leaving the tail
        return self._ipc("events.sock")

    @property
    def bridge_in(self) -> str:  # bridge PULL: token events, request ends, stats
        return self._internal("bridge-in")

    def stage_in(self, index: int) -> str:  # stage PULL: descriptors (head: its inbox)
        return self._internal(f"stage-{index}")

    def credits(self, edge: int) -> str:  # producer of edge k binds PULL for its credits
        return self._internal(f"credits-{edge}")

    def kv_in(self, index: int) -> str:  # decode stage PULL: KV hand-off announcements and placements
        return self._internal(f"kv-{index}")

    def kvpool(self, index: int) -> str:  # stage ROUTER (a plan across hosts with a KV pool): its slices
        return self._internal(f"kvpool-{index}")

    def shard_in(self, number: int) -> str:  # expert shard PULL: work from its stage
        return self._internal(f"shard-{number}")

    def experts_out(self, stage: int) -> str:  # stage PULL: its expert shards' results
        return self._internal(f"experts-{stage}")

    @property
    def control(self) -> str:  # launcher PULL: Ready, Drained
        return self._internal("control")

    @property
    def hosts(self) -> str:  # launcher ROUTER: the followers (kvasird join) of a plan across hosts
        return self._internal("hosts")

    def command(self, name: str) -> str:  # child PULL: commands from the launcher
        if name.startswith("front-"):  # an HTTP front runs beside the launcher, on every plan
            return self._ipc(f"command-{name}.sock")
        return self._internal(f"command-{name}")

    def socket_files(self) -> list[Path]:
        """The daemon's own socket files in the runtime dir (never another program's)."""
        from kvasir.transport.rundir import is_ours

        return sorted(path for path in self.dir.glob("*.sock") if is_ours(path.name))

    def bridge_files(self) -> list[Path]:
        """The socket files the bridge binds (a killed bridge leaves them behind)."""
        return [
            Path(url.removeprefix("ipc://"))
            for url in (self.client, self.events, self.bridge_in, self.command("bridge"))
            if url.startswith("ipc://")
        ]


MAX_INTERNAL_MESSAGE = 64 * MIB  # internal messages are small; a larger frame drops its connection


SocketT = TypeVar("SocketT", bound=zmq.Socket)


def waiting(sock: zmq.Socket, multipart: bool = False, copy: bool = True) -> Iterator[Any]:
    """Every message already waiting on ``sock``, without blocking. ZMQ's EVENTS can say
    POLLIN for input that is not a whole message yet (a large multipart message still
    arriving over TCP, a CURVE handshake); the receive then says Again, which ends the
    batch: the rest comes with the next wake-up."""
    recv = sock.recv_multipart if multipart else sock.recv
    while cast(int, sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
        try:
            yield recv(zmq.NOBLOCK, copy=copy)
        except zmq.Again:
            return


def make_socket(
    ctx: zmq.Context[SocketT],
    kind: int,
    *,
    bind: str | None = None,
    connect: str | None = None,
    fabric: Fabric | None = None,
) -> SocketT:
    """A socket of ``ctx``'s kind (an asyncio context makes asyncio sockets), with no
    linger and the internal message size limit, bound or connected. A ``tcp://``
    endpoint (a plan across hosts) is CURVE-secured by ``fabric``, and refused without it."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_INTERNAL_MESSAGE)
    endpoint = bind or connect or ""
    try:
        if endpoint.startswith("tcp://"):
            if fabric is None:
                raise KvasirError(
                    f"{endpoint}: an internal TCP socket needs the hosts' CURVE keys, and none were given"
                )
            fabric.secure(sock, bind=bind, connect=connect)
        if bind is not None:
            sock.bind(bind)
        if connect is not None:
            sock.connect(connect)
    except BaseException:
        sock.close(linger=0)  # a socket left open would hold up the context's end
        raise
    return sock


class PushChannel(Generic[T]):
    """Sends one message type over a PUSH socket."""

    def __init__(self, sock: zmq.Socket) -> None:
        self.socket = sock
        self._encoder = msgspec.msgpack.Encoder()

    def send(self, message: T, frames: list | tuple = ()) -> None:
        """``frames``: bytes sent after the message in the same multipart message, no copy."""
        if frames:
            self.socket.send_multipart([self._encoder.encode(message), *frames], copy=False)
        else:
            self.socket.send(self._encoder.encode(message), copy=False)


class PullChannel(Generic[T]):
    """Receives one message type (or tagged union) from a PULL socket, typed-decoded.

    A frame that does not decode (a bug, a version mix after an upgrade, a stray process
    of the daemon's user writing to the runtime dir) is dropped, counted and logged: it
    never takes the receiving process down.
    """

    def __init__(self, sock: zmq.Socket, message_type: Any, log=None) -> None:
        self.socket = sock
        self._decoder: Decoder[T] = Decoder(message_type)
        self.log = log
        self.dropped = 0

    def recv(self) -> T:
        """The next message that decodes (waits; malformed frames are dropped on the way)."""
        while True:
            try:
                return self._decoder.decode(self.socket.recv())
            except Malformed as exc:
                self.drop(f"{exc}")

    def drain(self) -> list[T]:
        """Every message already waiting, without blocking (messages are small: copying
        them out is cheaper than zero-copy frames, and checking EVENTS cheaper than
        catching zmq.Again)."""
        out = []
        decode = self._decoder.decode
        for frame in waiting(self.socket):
            try:
                out.append(decode(frame))
            except Malformed as exc:
                self.drop(f"{exc}")
        return out

    def drain_framed(self) -> list[tuple[T, list[zmq.Frame]]]:
        """As ``drain``, for multipart messages: each message with the frames after it."""
        out = []
        decode = self._decoder.decode
        for parts in waiting(self.socket, multipart=True, copy=False):
            try:
                out.append((decode(parts[0].buffer), parts[1:]))
            except Malformed as exc:
                self.drop(f"{exc}")
        return out

    def drop(self, why: str) -> None:
        """Count and log a message that was dropped (it did not decode, or contradicts the
        receiver's state in a way only a stray or hostile sender explains)."""
        self.dropped += 1
        if self.log is not None:
            self.log.warning(
                "dropped a malformed internal message",
                socket=cast(bytes, self.socket.get(zmq.LAST_ENDPOINT)).decode(),
                error=why,
                dropped=self.dropped,
            )


NOBLOCK = int(zmq.NOBLOCK)  # plain ints: combining pyzmq's flag enums costs more than the send
NOBLOCK_MORE = int(zmq.NOBLOCK) | int(zmq.SNDMORE)


class BatchedSocket:
    """A ZMQ socket driven from asyncio in batches: one wake-up for everything already
    waiting, and sends that never wait unless the socket is full.

    pyzmq's asyncio layer costs a future and a few callbacks per message; at tens of
    thousands of small messages a second that, not the socket, is the limit. This class
    owns the socket outright (its asyncio wrapper must not be used for I/O): it makes
    non-blocking calls on a synchronous shadow and waits on ZMQ's file descriptor itself.
    That descriptor is edge-triggered and any operation may consume its notification,
    so after every operation, and on every wake-up, the waiters re-check ZMQ's EVENTS.
    """

    def __init__(self, sock, max_batch: int = 512) -> None:
        self.socket = sock  # bind, connect, options and close stay with the caller
        self.shadow: zmq.Socket = zmq.Socket.shadow(sock.underlying)
        self.max_batch = max_batch
        self._waiters: list[tuple[int, Any]] = []  # (zmq.POLLIN | zmq.POLLOUT, future)

    def _wake(self) -> None:
        if not self._waiters:
            return
        events = cast(int, self.shadow.get(zmq.EVENTS))
        for event, future in self._waiters:
            if events & event and not future.done():
                future.set_result(None)

    async def _wait(self, event: int) -> None:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        if not self._waiters:
            loop.add_reader(self.shadow.FD, self._wake)
        waiter = (event, future)
        self._waiters.append(waiter)
        try:
            self._wake()  # it may have happened already
            await future
        finally:
            self._waiters.remove(waiter)
            if not self._waiters:
                loop.remove_reader(self.shadow.FD)

    async def recv_batch(self, multipart: bool = False, copy: bool = True) -> list:
        """At least one message (frames lists with ``multipart``), at most ``max_batch``;
        ``copy`` False: zmq.Frame objects (their properties, e.g. "User-Id", readable)."""
        recv = self.shadow.recv_multipart if multipart else self.shadow.recv
        while True:
            out: list = []
            try:
                while len(out) < self.max_batch:
                    out.append(recv(NOBLOCK, copy=copy))
            except zmq.Again:
                pass
            if out:
                self._wake()
                return out
            await self._wait(zmq.POLLIN)

    async def send(self, data: bytes) -> None:
        await self.send_multipart([data])

    async def send_multipart(self, frames: list) -> None:
        """Queue a multipart message, waiting while the socket has no room."""
        while True:
            try:
                self.send_now(frames)
                return
            except zmq.Again:
                await self._wait(zmq.POLLOUT)

    def send_now(self, frames: list) -> None:
        """Queue a multipart message without waiting, or raise zmq.Again (no room; for a
        ROUTER with ROUTER_MANDATORY: no room for that peer) or ZMQError EHOSTUNREACH
        (ROUTER_MANDATORY: no such peer); then nothing was queued. ZMQ takes a multipart
        message whole or not at all: once the first frame is queued, the rest are too."""
        last = len(frames) - 1
        try:
            self.shadow.send(frames[0], NOBLOCK_MORE if last else NOBLOCK)
            for index in range(1, last + 1):
                self.shadow.send(frames[index], NOBLOCK_MORE if index < last else NOBLOCK)
        finally:
            self._wake()  # a failed send may have consumed the descriptor's notification too
