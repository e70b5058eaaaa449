"""The launcher's HTTP fronts (a plan's ``[http]``): one listening socket, bound here
before anything else starts, shared by ``http.workers`` front processes that inherit it.

A front is a client of the bridge and holds no request of anyone else, so its failure
is its own: a front that exits or goes silent is restarted alone, with a back-off when
it keeps failing, and the ring, the bridge and ZeroMQ clients never notice. While one
restarts, connections wait in the socket's backlog (the socket is the launcher's).
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Callable

from kvasir.config.http import HttpSpec, parse_listen
from kvasir.daemon.children import Child, ending, join_children, spawn_child
from kvasir.daemon.forks import Zygote
from kvasir.daemon.supervision import Heartbeats, RestartPolicy
from kvasir.errors import KvasirError
from kvasir.transport.fabric import Sockets
from kvasir.wire.control import Command, Heartbeat, Ready, WorkerSettings

BACKLOG = 1024  # connections waiting to be accepted (while a front restarts, say)


class FrontError(KvasirError):
    """The HTTP address cannot be bound, or a front failed while the daemon started."""


class Fronts:
    def __init__(
        self,
        spec: HttpSpec | None,
        sockets: Sockets,
        settings: Callable[[int, int], WorkerSettings],  # (index, listening fd) -> a front's settings
        heartbeat_timeout_s: float,
        restart_window_s: float,
        log,
        *,
        zygote: Zygote | None = None,  # forks each front where there is one (kvasir/daemon/forks.py)
    ) -> None:
        self.spec = spec
        self.zygote = zygote
        self.sockets = sockets
        self.settings = settings
        self.log = log
        self.heartbeats = Heartbeats(heartbeat_timeout_s)
        self.window_s = restart_window_s
        self.listener: socket.socket | None = None
        self.running: dict[int, Child] = {}
        self.policies: dict[int, RestartPolicy] = {}
        self.due: dict[int, float] = {}  # fronts waiting out their back-off: when to start them

    @property
    def workers(self) -> int:
        return self.spec.workers if self.spec is not None else 0

    @property
    def ready(self) -> bool:
        return all(child.ready for child in self.running.values()) and len(self.running) == self.workers

    def bind(self) -> None:
        """Bind ``http.listen`` (FrontError naming it when that fails)."""
        if self.spec is None:
            return
        where = parse_listen(self.spec.listen)
        if where is None:  # the plan check refuses it first
            raise FrontError(f"http.listen = {self.spec.listen!r} is not HOST:PORT")
        host, port = where
        try:
            family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
            listener = socket.socket(family, socket.SOCK_STREAM)
        except OSError as exc:
            raise FrontError(f"cannot bind http.listen = {self.spec.listen}: {exc}") from None
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((host, port))
            listener.listen(BACKLOG)
        except OSError as exc:
            listener.close()
            raise FrontError(f"cannot bind http.listen = {self.spec.listen}: {exc.strerror or exc}") from None
        self.listener = listener
        self.log.info("http listening", listen=self.spec.listen, workers=self.workers)

    def start(self) -> None:
        for index in range(self.workers):
            self._spawn(index)

    def note(self, message: Ready | Heartbeat, now: float) -> None:
        child = self.running.get(message.index)
        if child is None or child.process.pid != message.pid:
            return
        if isinstance(message, Ready):
            child.ready = True
            self.heartbeats.watch(child.name, now)
        else:
            self.heartbeats.beat(child.name, now)

    def exited(self) -> str | None:
        """A front that has exited (while starting, that stops the daemon): what happened."""
        for child in self.running.values():
            code = child.process.poll()
            if code is not None:
                return f"{child.name} (pid {child.process.pid}) {ending(code)}"
        return None

    def check(self, now: float) -> None:
        """Restart fronts that exited or hung, each after its own back-off."""
        silent = self.heartbeats.silent(now)  # once a look: it forgives pauses of the launcher itself
        for index, child in list(self.running.items()):
            why = self._why_failed(child, silent)
            if why is None:
                continue
            self._end(index)
            policy = self.policies.setdefault(index, RestartPolicy(sys.maxsize, self.window_s))
            delay = policy.failed(now) or 0.0
            self.log.error("http front failed; restarting it alone", front=child.name, reason=why, delay_s=delay)
            self.due[index] = now + delay
        for index, at in list(self.due.items()):
            if now >= at:
                del self.due[index]
                self._spawn(index)

    def stop(self, timeout_s: float) -> None:
        for child in self.running.values():
            if child.process.poll() is None:
                child.command.send(Command("stop"))
        join_children(self.log, list(self.running.values()), timeout_s)
        for index in list(self.running):
            self._end(index)
        self.due.clear()

    def close(self) -> None:
        """Kill what still runs and close the listening socket."""
        for index in list(self.running):
            self._end(index)
        if self.listener is not None:
            self.listener.close()
            self.listener = None

    def _why_failed(self, child: Child, silent: tuple[str, float] | None) -> str | None:
        code = child.process.poll()
        if code is not None:
            return ending(code)
        if silent is not None and silent[0] == child.name:
            return f"hung: no heartbeat for {silent[1]:.1f} s"
        return None

    def _spawn(self, index: int) -> None:
        if self.listener is None:
            raise FrontError("the HTTP address is not bound")
        fd = self.listener.fileno()
        child = spawn_child(self.settings(index, fd), self.sockets, pass_fds=(fd,), zygote=self.zygote)
        self.running[index] = child
        self.log.info("spawned", child=child.name, pid=child.process.pid)

    def _end(self, index: int) -> None:
        child = self.running.pop(index)
        if child.process.poll() is None:
            child.process.kill()
        child.process.wait()
        child.command.socket.close(linger=0)
        self.heartbeats.forget(child.name)
