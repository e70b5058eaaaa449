"""The launcher's listening socket for the HTTP fronts: bound once, refused clearly."""

from __future__ import annotations

import socket

import pytest

from kvasir.config.http import HttpSpec
from kvasir.daemon.fronts import FrontError, Fronts
from kvasir.logs import setup_logging


def fronts(listen: str) -> Fronts:
    return Fronts(HttpSpec(listen=listen), None, None, 30.0, 600.0, setup_logging("error"))  # type: ignore[arg-type]


def test_a_taken_port_is_refused_naming_the_key_and_no_http_binds_nothing():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(FrontError, match=f"cannot bind http.listen = 127.0.0.1:{port}"):
            fronts(f"127.0.0.1:{port}").bind()
    free = fronts("127.0.0.1:0")
    with pytest.raises(FrontError):
        free.bind()  # port 0 is not HOST:PORT (the plan check refuses it first)
    none = Fronts(None, None, None, 30.0, 600.0, setup_logging("error"))  # type: ignore[arg-type]
    none.bind()
    assert none.listener is None and none.ready and none.workers == 0


def test_the_socket_is_bound_once_and_closed_with_the_fronts():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    owner = fronts(f"127.0.0.1:{port}")
    owner.bind()
    assert owner.listener is not None and owner.listener.getsockname()[1] == port
    with socket.create_connection(("127.0.0.1", port), timeout=5):
        pass  # connections wait in the backlog while no front accepts
    owner.close()
    assert owner.listener is None
