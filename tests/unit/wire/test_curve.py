"""CURVE between hosts on real sockets over loopback TCP (kvasir/wire/curve.py): a listed
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
from kvasir.wire.control import Heartbeat
from kvasir.wire.curve import Fabric, FabricError, HostKeys
from kvasir.wire.routes import Placement, Routes
from kvasir.wire.transport import Endpoints, PullChannel, PushChannel, make_socket

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


@pytest.fixture
def hosts(tmp_path, unused_tcp_port):
    made = CliRunner().invoke(kvasir, ["keys", "generate", str(tmp_path), "--host", "a", "--host", "b", "--host", "x"])
    assert made.exit_code == 0, made.output
    routes = Routes(Placement.of(parse_plan(PLAN.format(port=unused_tcp_port))))
    fabrics = {name: Fabric(routes, HostKeys.load(tmp_path, name, ["a", "b"])) for name in ("a", "b")}
    ctx = zmq.Context()
    auth = fabrics["a"].authenticator(ctx)
    yield tmp_path, routes, fabrics, ctx
    auth.stop()
    ctx.destroy(linger=0)


def handshake(sock: zmq.Socket, timeout_s: float = 30.0) -> int:
    """The first handshake outcome the connecting socket reports."""
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                                      | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)  # fmt: skip
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if monitor.poll(100):
            return recv_monitor_message(monitor)["event"]
    raise AssertionError("no handshake outcome within the bound")


def test_a_listed_host_reaches_the_leaders_control_socket(hosts):
    folder, routes, fabrics, ctx = hosts
    ends = Endpoints(folder, routes)
    inbox = PullChannel(make_socket(ctx, zmq.PULL, bind=ends.control, fabric=fabrics["a"]), Heartbeat)
    sender = make_socket(ctx, zmq.PUSH, connect=ends.control, fabric=fabrics["b"])
    assert handshake(sender) == zmq.EVENT_HANDSHAKE_SUCCEEDED
    PushChannel[Heartbeat](sender).send(Heartbeat("stage", 1, 42))
    assert inbox.socket.poll(30_000) and inbox.recv() == Heartbeat("stage", 1, 42)


def test_an_unlisted_key_and_a_plaintext_peer_are_refused(hosts):
    folder, routes, fabrics, ctx = hosts
    ends = Endpoints(folder, routes)
    inbox = make_socket(ctx, zmq.PULL, bind=ends.control, fabric=fabrics["a"])
    stranger = Fabric(routes, HostKeys.load(folder, "x", ["a", "b", "x"]))  # a real pair, not one of the plan's
    intruder = make_socket(ctx, zmq.PUSH, connect=ends.control, fabric=stranger)
    assert handshake(intruder) == zmq.EVENT_HANDSHAKE_FAILED_AUTH
    plain = ctx.socket(zmq.PUSH)
    plain.connect(ends.control)
    assert handshake(plain) in (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
    for sock in (intruder, plain):
        with contextlib.suppress(zmq.Again):  # queued at most: no handshake, no delivery
            sock.send(b"\x01", zmq.NOBLOCK)
    assert not inbox.poll(500)  # nothing got in
    plain.close()


def test_no_internal_tcp_socket_without_keys(hosts):
    folder, routes, fabrics, ctx = hosts
    with pytest.raises(KvasirError, match="needs the hosts' CURVE keys"):
        make_socket(ctx, zmq.PULL, bind=Endpoints(folder, routes).control)
    with pytest.raises(FabricError, match="is not a socket of this plan's hosts"):
        make_socket(ctx, zmq.PUSH, connect="tcp://127.0.0.9:1", fabric=fabrics["b"])
    with pytest.raises(FabricError, match="does not match"):
        HostKeys.load(folder, "a", ["a", "b"], secret_file=folder / "b.key_secret")
