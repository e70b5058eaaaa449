"""The start-up exchange of CUDA IPC handles between the two stages of an edge.

Each side sends the handles of what it made (the consumer: its slot buffers and its
"slot read" events; the producer: its "slot written" events) to the launcher in an
``EdgeHandles`` message; once both halves of an edge are in, the launcher sends each
side the other's half in an "attach" command. This happens once per stage process:
batch descriptors then carry the slot index only. Handles are bytes in msgspec
messages (never pickle).
"""

from __future__ import annotations

import os
import time
from typing import Protocol

import zmq

from kvasir.errors import KvasirError
from kvasir.wire.base import Side
from kvasir.wire.control import Command, EdgeHandles, EdgeSpec


class HandshakeError(KvasirError):
    """The CUDA IPC handle exchange did not complete, or a handle did not belong to this edge."""


# -- the launcher's side of the handshake ------------------------------------------------
class HandleExchange:
    """Pairs the two halves of every CUDA IPC edge as the stages send them.

    ``edges`` maps an edge's name to (producer's global index, consumer's global index).
    ``offer`` takes one half from a stage and returns what to send now: (stage index,
    the other side's half) twice once both halves of the edge are in, else nothing.
    """

    def __init__(self, edges: dict[str, tuple[int, int]]) -> None:
        self.edges = edges
        self._halves: dict[tuple[str, str], EdgeHandles] = {}

    def clear(self) -> None:
        """New stage processes: every edge is exchanged again."""
        self._halves.clear()

    def offer(self, half: EdgeHandles) -> list[tuple[int, EdgeHandles]]:
        ends = self.edges.get(half.edge)
        if ends is None:
            raise HandshakeError(f"stage {half.index} sent handles for {half.edge!r}, which is not a CUDA IPC edge")
        producer, consumer = ends
        expected = producer if half.side == "producer" else consumer if half.side == "consumer" else None
        if half.index != expected:
            raise HandshakeError(
                f"stage {half.index} sent the {half.side!r} half of {half.edge}, which is not its side"
            )
        self._halves[(half.edge, half.side)] = half
        producer_half = self._halves.get((half.edge, "producer"))
        consumer_half = self._halves.get((half.edge, "consumer"))
        if producer_half is None or consumer_half is None:
            return []
        return [(producer, consumer_half), (consumer, producer_half)]


# -- a stage's side of the handshake -----------------------------------------------------
class IpcRing(Protocol):
    """A slot ring that needs the other side's handles before it can be used."""

    spec: EdgeSpec
    side: Side

    def local_half(self, index: int, pid: int) -> EdgeHandles: ...

    def attach(self, peer: EdgeHandles) -> None: ...


def exchange_handles(
    rings: list[IpcRing],
    index: int,
    control,
    commands,
    *,
    launcher_pid: int,
    timeout_s: float,
    poll_ms: int = 50,
) -> None:
    """Send this stage's halves to the launcher, then wait for the other sides' halves and
    attach each ring. ``control``: PushChannel[ControlMessage]; ``commands``:
    PullChannel[Command]. Stops with HandshakeError on "stop", a gone launcher or timeout."""
    if not rings:
        return
    waiting = {ring.spec.name: ring for ring in rings}
    for ring in rings:
        control.send(ring.local_half(index, os.getpid()))
    deadline = time.monotonic() + timeout_s
    while waiting:
        if commands.socket.poll(poll_ms, zmq.POLLIN):
            for command in commands.drain():
                _take(command, waiting)
        if os.getppid() != launcher_pid:
            raise HandshakeError("the launcher is gone")
        if time.monotonic() > deadline:
            raise HandshakeError(f"no CUDA IPC handles for {', '.join(sorted(waiting))} within {timeout_s:g} s")


def _take(command: Command, waiting: dict[str, IpcRing]) -> None:
    if command.kind == "stop":
        raise HandshakeError("stopped before the CUDA IPC handles came")
    if command.kind != "attach":
        return
    for peer in command.handles:
        ring = waiting.get(peer.edge)
        if ring is None or peer.side == ring.side:
            raise HandshakeError(f"handles for {peer.edge} ({peer.side} side) are not for this stage")
        ring.attach(peer)
        del waiting[peer.edge]
