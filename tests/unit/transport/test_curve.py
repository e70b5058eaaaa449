"""CURVE between hosts on real sockets over loopback TCP (kvasir/transport/curve.py): a listed
host gets through, an unlisted key or a plaintext peer is refused at the handshake."""

from __future__ import annotations

import contextlib
import time

import pytest
import zmq
from click.testing import CliRunner
from zmq.utils.monitor import recv_monitor_message

from kvasir.cli.main import kvasir
from kvasir.config.plan import parse_plan
from kvasir.errors import KvasirError
from kvasir.transport.channels import Endpoints, PullChannel, PushChannel, make_socket
from kvasir.transport.curve import Fabric, FabricError, HostKeys
from kvasir.transport.routes import Placement, Routes
from kvasir.wire.control import Heartbeat

PLAN = """
[cluster]
leader = "a"
keys = "keys"
[hosts.a]
address = "127.0.0.1"
port = {port}
[hosts.b]
address = "127.0.0.2"
port = {port}
[[stages]]
layers = [0, 3]
[[stages]]
layers = [3, 6]
host = "b"
"""


class Hosts:
    """Two hosts' fabrics over loopback; every socket made here is closed before the
    authenticator stops and the context ends (closing sockets another thread owns, or
    stopping ZAP under a pending handshake, can hang the context's end)."""

    def __init__(self, folder, routes, fabrics) -> None:
        self.folder, self.routes, self.fabrics = folder, routes, fabrics
        self.ends = Endpoints(folder, routes)
        self.ctx = zmq.Context()
        self.auth = fabrics["a"].authenticator(self.ctx)
        self.sockets: list[zmq.Socket] = []

    def socket(self, kind: int) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        self.sockets.append(sock)
        return sock

    def close(self) -> None:
        for sock in self.sockets:
            sock.close(linger=0)
        self.auth.stop()
        self.ctx.term()


@pytest.fixture
def hosts(tmp_path, unused_tcp_port):
    made = CliRunner().invoke(kvasir, ["keys", "generate", str(tmp_path), "--host", "a", "--host", "b", "--host", "x"])
    assert made.exit_code == 0, made.output
    routes = Routes.of(Placement.of(parse_plan(PLAN.format(port=unused_tcp_port))))
    fabrics = {name: Fabric.of(routes, HostKeys.load(tmp_path, name, ["a", "b"])) for name in ("a", "b")}
    fabrics["x"] = Fabric.of(routes, HostKeys.load(tmp_path, "x", ["a", "b", "x"]))  # a real pair, not the plan's
    made_hosts = Hosts(tmp_path, routes, fabrics)
    yield made_hosts
    made_hosts.close()


def connect(
    hosts: Hosts, fabric: Fabric | None, timeout_s: float = 60.0, endpoint: str | None = None
) -> tuple[zmq.Socket, int]:
    """A PUSH socket to the leader's control socket (or ``endpoint``), monitored from before
    it connects (a refused plaintext peer is reported once, and not retried), and the first
    handshake outcome it reports."""
    endpoint = endpoint or hosts.ends.control
    sock = hosts.socket(zmq.PUSH)
    if fabric is not None:
        fabric.secure(sock, connect=endpoint)
    events = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    monitor = sock.get_monitor_socket(events | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
    hosts.sockets.append(monitor)
    sock.connect(endpoint)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if monitor.poll(100):
            return sock, recv_monitor_message(monitor)["event"]
    raise AssertionError("no handshake outcome within the bound")


def test_a_listed_host_reaches_the_leaders_control_socket(hosts):
    inbox = PullChannel(hosts.socket(zmq.PULL), Heartbeat)
    hosts.fabrics["a"].secure(inbox.socket, bind=hosts.ends.control)
    inbox.socket.bind(hosts.ends.control)
    sender, outcome = connect(hosts, hosts.fabrics["b"])
    assert outcome == zmq.EVENT_HANDSHAKE_SUCCEEDED
    PushChannel[Heartbeat](sender).send(Heartbeat("stage", 1, 42))
    assert inbox.socket.poll(30_000) and inbox.recv() == Heartbeat("stage", 1, 42)


def test_an_unlisted_key_and_a_plaintext_peer_are_refused(hosts):
    inbox = hosts.socket(zmq.PULL)
    hosts.fabrics["a"].secure(inbox, bind=hosts.ends.control)
    inbox.bind(hosts.ends.control)
    intruder, outcome = connect(hosts, hosts.fabrics["x"])
    assert outcome == zmq.EVENT_HANDSHAKE_FAILED_AUTH
    plain, outcome = connect(hosts, None)
    assert outcome in (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
    for sock in (intruder, plain):
        with contextlib.suppress(zmq.Again):  # queued at most: no handshake, no delivery
            sock.send(b"\x01", zmq.NOBLOCK)
    assert not inbox.poll(500)  # nothing got in


def test_no_internal_tcp_socket_without_keys(hosts):
    folder, ctx = hosts.folder, hosts.ctx
    with pytest.raises(KvasirError, match="needs the hosts' CURVE keys"):
        make_socket(ctx, zmq.PULL, bind=hosts.ends.control)
    with pytest.raises(FabricError, match="is not a socket of this plan's hosts"):
        make_socket(ctx, zmq.PUSH, connect="tcp://127.0.0.9:1", fabric=hosts.fabrics["b"])
    with pytest.raises(FabricError, match="does not match"):
        HostKeys.load(folder, "a", ["a", "b"], secret_file=folder / "b.key_secret")
    pull = make_socket(ctx, zmq.PULL, bind=hosts.ends.control, fabric=hosts.fabrics["a"])
    hosts.sockets.append(pull)
    assert pull.curve_server and pull.zap_domain == b"kvasir-hosts"


def test_command_sockets_let_in_the_leaders_key_alone(hosts):
    """A follower's key reaches what its workers need (control, above), never a command
    socket: with it a compromised follower could drain or stop the bridge."""
    command = hosts.routes.endpoint("command-bridge")
    inbox = make_socket(hosts.ctx, zmq.PULL, bind=command, fabric=hosts.fabrics["a"])
    hosts.sockets.append(inbox)
    assert inbox.zap_domain == b"kvasir-leader"
    _, outcome = connect(hosts, hosts.fabrics["b"], endpoint=command)
    assert outcome == zmq.EVENT_HANDSHAKE_FAILED_AUTH
    launcher, outcome = connect(hosts, hosts.fabrics["a"], endpoint=command)
    assert outcome == zmq.EVENT_HANDSHAKE_SUCCEEDED
    launcher.send(b"stop")
    assert inbox.poll(30_000) and inbox.recv() == b"stop"
