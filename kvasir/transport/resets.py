"""When a socket's connections last dropped, from ZeroMQ's socket monitor.

A host whose processes die has its TCP connections reset by its kernel at once; the
socket at the other end sees a disconnect long before any heartbeat is missed. The
monitor says *that* a connection dropped, not whose: the launcher and the follower treat
it as a reason to expect word from the other side within a short grace (a live peer
reconnects and speaks within ``RECONNECT_GRACE_S``), never as a loss by itself.
"""

from __future__ import annotations

import time

import zmq
from zmq.utils.monitor import recv_monitor_message

RECONNECT_GRACE_S = 1.2  # a live peer reconnects (100 ms) and speaks (every 0.5 s) within this
IN_FLIGHT_S = 0.3  # a message read this soon after a drop may have been sent before it: no answer


class Resets:
    """The monitor of one socket (an inproc PAIR on its context, closed with it)."""

    def __init__(self, sock: zmq.Socket, keep) -> None:
        """``keep``: what ends the monitor with the process's other sockets (Sockets.keep)."""
        self.monitor = keep(sock.get_monitor_socket(zmq.EVENT_DISCONNECTED))
        self.last = 0.0  # monotonic time the last drop was read (0: none yet)

    def latest(self) -> float:
        """Read the drops reported since the last call; when the latest was read."""
        while True:
            try:
                recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return self.last
            self.last = time.monotonic()

    def unanswered(self, heard: float, now: float) -> bool:
        """Whether a connection dropped, the peer was not ``heard`` from since (a message
        read within ``IN_FLIGHT_S`` of the drop may have left before it: a dead peer's last
        words), and the grace for it to come back has passed."""
        reset = self.latest()
        return reset > 0.0 and heard < reset + IN_FLIGHT_S and now - reset > RECONNECT_GRACE_S
