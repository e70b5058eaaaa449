"""Ports the bench and the tests hand to a daemon's plan: free, distinct, and outside the
range the kernel gives outgoing connections (which could take one before the daemon binds)."""

import socket

import pytest

from kvasir.bench.daemon import BenchDaemonError, _ephemeral_floor, free_ports


def test_ports_are_distinct_free_and_below_the_ephemeral_range():
    ports = free_ports(6)
    assert len(set(ports)) == 6
    assert all(10_000 <= port < _ephemeral_floor() for port in ports)
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_window_with_every_port_held_is_named():
    """lowest above the ephemeral floor leaves a two-port window: 65534 and 65535, both held."""
    with socket.socket() as first, socket.socket() as second:
        try:
            first.bind(("127.0.0.1", 65534))
            second.bind(("127.0.0.1", 65535))
        except OSError:
            pytest.skip("ports 65534 and 65535 are in use here")
        with pytest.raises(BenchDaemonError, match="found only 0 of 1 free ports from 65534"):
            free_ports(1, lowest=65534)
