"""The sd_notify protocol, against a real unix datagram socket."""

from __future__ import annotations

import os
import socket

import pytest

from kvasir.daemon.notify import ServiceNotifier


@pytest.fixture
def listener(tmp_path):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = tmp_path / "notify.sock"
    sock.bind(str(path))
    sock.settimeout(2)
    yield str(path), sock
    sock.close()


def test_ready_status_stopping_are_datagrams_of_lines(listener):
    path, sock = listener
    notifier = ServiceNotifier(path)
    notifier.status("loading 2 stages")
    notifier.ready("serving 2 stages")
    notifier.stopping("draining")
    assert sock.recv(4096) == b"STATUS=loading 2 stages"
    assert sock.recv(4096) == b"READY=1\nSTATUS=serving 2 stages"
    assert sock.recv(4096) == b"STOPPING=1\nSTATUS=draining"
    notifier.close()


def test_watchdog_pings_at_half_the_interval(listener):
    path, sock = listener
    now = [100.0]
    notifier = ServiceNotifier(path, watchdog_s=10.0, clock=lambda: now[0])
    sent = []
    for t in (100.0, 101.0, 104.9, 105.0, 109.0, 110.1):
        now[0] = t
        notifier.watchdog()
    sock.setblocking(False)
    while True:
        try:
            sent.append(sock.recv(4096))
        except BlockingIOError:
            break
    assert sent == [b"WATCHDOG=1"] * 3  # at 100, 105 and 110.1


def test_environment_and_no_systemd(monkeypatch, listener):
    path, sock = listener
    env = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "3000000", "WATCHDOG_PID": str(os.getpid())}
    notifier = ServiceNotifier.from_environment(env)
    assert notifier.enabled and notifier.watchdog_s == 3.0
    assert ServiceNotifier.from_environment(env | {"WATCHDOG_PID": "1"}).watchdog_s is None  # meant for another process
    assert ServiceNotifier.from_environment({"WATCHDOG_USEC": "x"}).watchdog_s is None
    assert ServiceNotifier("@kvasir-test").address == "\0kvasir-test"  # abstract namespace
    quiet = ServiceNotifier.from_environment({})
    assert not quiet.enabled
    quiet.ready("nothing listens")  # a no-op outside systemd
    ServiceNotifier(str(path) + ".absent").ready("nobody")  # an unreachable socket is not an error
