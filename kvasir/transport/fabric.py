"""A process's internal sockets, made one way whatever the plan: ``ipc://`` files in the
runtime directory on one machine, TCP with CURVE (kvasir/transport/curve.py) when the plan
spans hosts and the worker's settings carry the routes (``FabricSettings``).

``Sockets`` makes every internal socket of a process on one context, starts the
context's ZAP handler when the process first binds a TCP socket, and ends them in the
order CURVE needs (its sockets, then the handler, then the context).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import zmq

from kvasir.transport.channels import Endpoints, make_socket
from kvasir.transport.curve import Fabric, HostKeys, end_context
from kvasir.transport.routes import Routes
from kvasir.wire.control import FabricSettings


def open_fabric(runtime_dir: str | Path, settings: FabricSettings | None) -> tuple[Endpoints, Fabric | None]:
    """The endpoints of a worker's sockets and, across hosts, the keys they authenticate with
    (FabricError when the host keys do not load)."""
    if settings is None:
        return Endpoints(runtime_dir), None
    routes = Routes(settings.sockets)
    hosts = {owner for _, owner in settings.sockets.values()} | {settings.host}
    keys = HostKeys.load(settings.keys, settings.host, sorted(hosts), settings.secret)
    return Endpoints(runtime_dir, routes), Fabric.of(routes, keys)


class Sockets:
    """The internal sockets of one process, on one context."""

    def __init__(self, ctx: zmq.Context, ends: Endpoints, fabric: Fabric | None, authenticator: Any = None) -> None:
        """``authenticator``: the context's ZAP handler, where the process already runs one
        (the bridge's, for its remote clients); the hosts' domain is added to it."""
        self.ctx = ctx
        self.ends = ends
        self.fabric = fabric
        self.authenticator = authenticator
        self._hosts_allowed = False
        self._made: list[zmq.Socket] = []

    def bind(self, kind: int, endpoint: str) -> Any:
        if endpoint.startswith("tcp://") and self.fabric is not None and not self._hosts_allowed:
            if self.authenticator is None:
                self.authenticator = self.fabric.authenticator(self.ctx)
            else:
                self.fabric.allow(self.authenticator)
            self._hosts_allowed = True
        return self.keep(make_socket(self.ctx, kind, bind=endpoint, fabric=self.fabric))

    def connect(self, kind: int, endpoint: str) -> Any:
        return self.keep(make_socket(self.ctx, kind, connect=endpoint, fabric=self.fabric))

    def unbound(self, kind: int) -> Any:
        """A socket to set options on before ``attach`` connects it."""
        return self.keep(make_socket(self.ctx, kind))

    def attach(self, sock: zmq.Socket, endpoint: str) -> None:
        """Connect ``sock`` (made by ``unbound``) with the fabric's keys."""
        if endpoint.startswith("tcp://") and self.fabric is not None:
            self.fabric.secure(sock, connect=endpoint)
        sock.connect(endpoint)

    def keep(self, sock: Any) -> Any:
        """End ``sock`` with the others (a socket made elsewhere on the same context)."""
        self._made = [s for s in self._made if not s.closed]
        self._made.append(sock)
        return sock

    def end(self) -> None:
        """Close every socket made here, stop the ZAP handler, end the context."""
        end_context(self.ctx, self._made, self.authenticator)
        self._made = []
        self.authenticator = None
