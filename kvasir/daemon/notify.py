"""systemd's service notification protocol (sd_notify), spoken directly.

When systemd starts ``kvasird`` as a ``Type=notify`` service it sets ``NOTIFY_SOCKET``
(a unix datagram socket path, or ``@name`` in the abstract namespace); each
notification is one datagram of ``KEY=value`` lines: ``READY=1`` once every stage
serves, ``STOPPING=1`` on shutdown, ``STATUS=...`` for ``systemctl status``, and
``WATCHDOG=1`` at least every half ``WATCHDOG_USEC`` when the unit sets ``WatchdogSec``.
Outside systemd (no ``NOTIFY_SOCKET``) every call does nothing.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping


class ServiceNotifier:
    def __init__(self, address: str | None, watchdog_s: float | None = None, clock=time.monotonic) -> None:
        self.address = "\0" + address[1:] if address and address.startswith("@") else address
        self.watchdog_s = watchdog_s
        self._clock = clock
        self._next_watchdog = 0.0
        self._sock: socket.socket | None = None

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ) -> ServiceNotifier:
        """Read NOTIFY_SOCKET and WATCHDOG_USEC (honoured only when WATCHDOG_PID, if set, is us)."""
        watchdog_s = None
        usec, pid = environ.get("WATCHDOG_USEC"), environ.get("WATCHDOG_PID")
        if usec and usec.isdigit() and int(usec) > 0 and (not pid or pid == str(os.getpid())):
            watchdog_s = int(usec) / 1e6
        return cls(environ.get("NOTIFY_SOCKET") or None, watchdog_s)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, *lines: str) -> None:
        """One datagram; a failure to notify never takes the daemon down."""
        if self.address is None:
            return
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto("\n".join(lines).encode(), self.address)
        except OSError:
            pass

    def status(self, text: str) -> None:
        self.send(f"STATUS={text}")

    def ready(self, text: str) -> None:
        self.send("READY=1", f"STATUS={text}")

    def stopping(self, text: str) -> None:
        self.send("STOPPING=1", f"STATUS={text}")

    def watchdog(self) -> None:
        """Ping the watchdog when half its interval has passed since the last ping."""
        if self.watchdog_s is None:
            return
        now = self._clock()
        if now >= self._next_watchdog:
            self._next_watchdog = now + self.watchdog_s / 2
            self.send("WATCHDOG=1")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
