"""The client library's failure messages say what the connection did."""

from __future__ import annotations

import socket

import pytest

from kvasir.client import Client, NoDaemon, Remote
from tests.support.daemon import free_port


def test_nothing_listening_is_named(tmp_path):
    with pytest.raises(NoDaemon, match="nothing accepted the connection within 1 s"):
        Client(tmp_path, timeout_s=1.0, remote=Remote(f"tcp://127.0.0.1:{free_port()}"))


def test_a_silent_listener_is_not_a_daemon(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()  # accepts TCP, never speaks ZMQ
        with pytest.raises(NoDaemon, match="a connection was made, but no answer came within 1 s"):
            Client(tmp_path, timeout_s=1.0, remote=Remote(f"tcp://127.0.0.1:{s.getsockname()[1]}"))
