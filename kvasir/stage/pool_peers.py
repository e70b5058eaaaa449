"""The KV pool across hosts: a stage serves its stored slices to the stages of the same
layers on other hosts (``SliceServer``, a thread of its own), and reads from them what its
own host lacks (``PeerFetcher``, on its loop), over the plan's fabric (TCP with CURVE,
kvasir/transport/fabric.py).

The server reads a slice's file from its tiers' folders by name (a file is whole once
it has its name: kvasir/kvpool/disk.py ``DiskTier.read``, which checks it is a file of
the slice's size the pool wrote), so it needs no lock with the stage's writer; a file
evicted meanwhile, unfit or unreadable is a miss (a fault counted in the tier's health). A fetch keeps at most ``window`` slices asked for and
unanswered, and gives up at its deadline: what came by then is used, the rest computed.
The asker checks each slice as it checks its own files (kvasir/kvpool/slices.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Generator

import msgspec
import zmq

from kvasir.errors import KvasirError
from kvasir.kvpool.disk import DiskTier
from kvasir.wire.decoding import Decoder, Malformed
from kvasir.wire.kvpool import SliceGot, SliceWant

POLL_MS = 100
SERVER_HWM = 64  # replies queued for the askers at most (each one slice)
WINDOW = 8  # slices a fetch keeps asked for and unanswered


class SliceServer:
    """Serves ``layers``' slices from ``tiers`` (the stage's, fastest first) on a bound
    ROUTER; ``size_of``: a block key's slice size."""

    def __init__(
        self, socket: zmq.Socket, tiers: list[DiskTier], layers: tuple[int, int], size_of: Callable[[bytes], int]
    ) -> None:
        self.socket = socket
        socket.setsockopt(zmq.SNDHWM, SERVER_HWM)
        self.tiers = tiers
        self.layers = layers
        self.size_of = size_of
        self.served = 0
        self.malformed = 0
        self._stop = threading.Event()
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, name="kvpool-server", daemon=True)
        self._thread.start()

    def check(self) -> None:
        """Raise on the stage's thread if the server thread failed."""
        if self._failure is not None:
            raise RuntimeError(f"the KV pool's slice server failed: {self._failure!r}") from self._failure

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2 * POLL_MS / 1000)
        self.socket.close(linger=0)

    def _serve(self) -> None:
        decoder: Decoder[SliceWant] = Decoder(SliceWant)
        encoder = msgspec.msgpack.Encoder()
        try:
            while not self._stop.is_set():
                if not self.socket.poll(POLL_MS):
                    continue
                frames = self.socket.recv_multipart()
                try:
                    want = decoder.decode(frames[-1])
                except Malformed:
                    self.malformed += 1
                    continue
                data = self._read(want) if len(frames) == 2 else None
                reply = [frames[0], encoder.encode(SliceGot(want.key, data is not None))]
                self.socket.send_multipart(reply + ([data] if data is not None else []))
        except BaseException as exc:  # raised again on the stage's own thread
            self._failure = exc

    def _read(self, want: SliceWant) -> bytes | None:
        if tuple(want.layers) != self.layers:
            return None
        where, size = (want.key, self.layers), self.size_of(want.key)
        for tier in self.tiers:
            data = tier.read(where, size)
            if data is not None:
                self.served += 1
                return data
        return None


class PeerFetcher:
    """Reads slices from other hosts' stages (one DEALER per peer, made by ``connect``)."""

    def __init__(self, connect: Callable[[int], zmq.Socket], layers: tuple[int, int], window: int = WINDOW) -> None:
        self.connect = connect
        self.layers = layers
        self.window = window
        self.fetched_bytes = 0
        self.fetch_s = 0.0
        self.unknown = 0  # fetches from stages the plan does not have (nothing asked)
        self._peers: dict[int, zmq.Socket] = {}
        self._decoder: Decoder[SliceGot] = Decoder(SliceGot)
        self._encoder = msgspec.msgpack.Encoder()

    def fetch(self, peer: int, keys: list[bytes], deadline: float) -> Generator[bytes, None, None]:
        """Each of ``keys``' stored slices from stage ``peer``, in order, up to the first it
        does not have or that has not come by ``deadline`` (CLOCK_MONOTONIC); nothing from
        a stage the plan does not have."""
        socket = self._peers.get(peer)
        if socket is None:
            try:
                socket = self._peers[peer] = self.connect(peer)
            except KvasirError:  # no such stage (kvasir/transport/routes.py RouteError)
                self.unknown += 1
                return
        started = time.monotonic()
        asked: set[bytes] = set()
        got: dict[bytes, bytes | None] = {}  # key -> its bytes, or None: not found
        try:
            for position, key in enumerate(keys):
                for ask in keys[len(asked) : position + self.window]:
                    socket.send(self._encoder.encode(SliceWant(ask, self.layers)))
                    asked.add(ask)
                while key not in got:
                    if not self._receive(socket, asked, got, deadline):
                        return
                data = got.pop(key)
                if data is None:
                    return
                self.fetched_bytes += len(data)
                yield data
        finally:
            self.fetch_s += time.monotonic() - started

    def _receive(self, socket: zmq.Socket, wanted: set[bytes], got: dict, deadline: float) -> bool:
        """One reply into ``got`` (False: the deadline passed first). Replies to an
        earlier, abandoned fetch are dropped."""
        left_ms = int((deadline - time.monotonic()) * 1000)
        if left_ms <= 0 or not socket.poll(left_ms):
            return False
        frames = socket.recv_multipart()
        try:
            reply = self._decoder.decode(frames[0])
        except Malformed:
            return True
        if reply.key in wanted and reply.key not in got:
            got[reply.key] = bytes(frames[1]) if reply.found and len(frames) == 2 else None
        return True

    def close(self) -> None:
        for socket in self._peers.values():
            socket.close(linger=0)
        self._peers.clear()
