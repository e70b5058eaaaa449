"""Hosts as network namespaces (tests/support/netns.py): the internal sockets of a plan
across hosts reach each other over real TCP between namespaces, CURVE-authenticated, and
a key that is not one of the plan's hosts is refused. Skipped where namespaces cannot be
made (not root, no iproute2)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from click.testing import CliRunner

from kvasir.bench.netns import Network, netns_unavailable
from kvasir.cli.main import kvasir

pytestmark = pytest.mark.skipif(netns_unavailable() is not None, reason=str(netns_unavailable()))

# One side of the control socket, in a host's namespace: the leader binds it and prints
# what arrives; a follower connects with the keys of HOST and sends one heartbeat.
SIDE = """
import sys, zmq
from kvasir.config.plan import load_plan
from kvasir.wire.control import ControlMessage, Heartbeat
from kvasir.transport.curve import Fabric, HostKeys, end_context
from kvasir.transport.routes import Placement, Routes
from kvasir.transport.channels import Endpoints, PullChannel, PushChannel, make_socket

plan_path, host, role = sys.argv[1:4]
plan = load_plan(plan_path)
routes = Routes.of(Placement.of(plan))
folder = plan_path.rsplit("/", 1)[0] + "/keys"
fabric = Fabric.of(routes, HostKeys.load(folder, host, [*plan.hosts, host]))
ctx = zmq.Context()
ends = Endpoints("/nonexistent", routes)
if role == "leader":
    auth = fabric.authenticator(ctx)
    inbox = PullChannel(make_socket(ctx, zmq.PULL, bind=ends.control, fabric=fabric), ControlMessage)
    print("bound", flush=True)
    got = inbox.socket.poll(int(sys.argv[4]))
    print(repr(inbox.recv()) if got else "nothing", flush=True)
    end_context(ctx, [inbox.socket], auth)
else:
    out = PushChannel[ControlMessage](make_socket(ctx, zmq.PUSH, connect=ends.control, fabric=fabric))
    out.send(Heartbeat("stage", 1, 4242))
    out.socket.setsockopt(zmq.LINGER, 20000)
    out.socket.close()  # waits (up to LINGER) for the message to go
    ctx.term()
"""

PLAN = """
[model]
source = "{model}"
max_seq_len = 256
[kv]
num_blocks = 64
[cluster]
leader = "a"
keys = "keys"
[hosts.a]
address = "{a}"
[hosts.b]
address = "{b}"
[[stages]]
layers = [0, 3]
[[stages]]
layers = [3, 6]
host = "b"
"""


@pytest.fixture
def network():
    net = Network(["a", "b"])
    yield net
    net.close()


def side(network: Network, host: str, args: list[str], started: list[subprocess.Popen]) -> subprocess.Popen:
    process = network.run(host, [sys.executable, "-c", SIDE, *args], stdout=subprocess.PIPE, text=True)
    started.append(process)
    return process


def test_a_follower_reaches_the_leader_across_namespaces_and_a_stranger_does_not(network, tmp_path, tiny_models):
    keys = CliRunner().invoke(
        kvasir, ["keys", "generate", str(tmp_path / "keys"), "--host", "a", "--host", "b", "--host", "x"]
    )
    assert keys.exit_code == 0, keys.output
    plan = tmp_path / "plan.toml"
    plan.write_text(PLAN.format(model=tiny_models["llama"], a=network.address("a"), b=network.address("b")))
    started: list[subprocess.Popen] = []
    try:
        leader = side(network, "a", [str(plan), "a", "leader", "60000"], started)
        assert leader.stdout.readline().strip() == "bound"
        follower = side(network, "b", [str(plan), "b", "follower"], started)
        expected = "Heartbeat(role='stage', index=1, pid=4242)"
        assert leader.wait(timeout=90) == 0 and leader.stdout.read().strip() == expected
        assert follower.wait(timeout=60) == 0
        # host x's key is a real pair, but not one of the plan's hosts: nothing it sends gets in
        leader = side(network, "a", [str(plan), "a", "leader", "3000"], started)
        assert leader.stdout.readline().strip() == "bound"
        side(network, "b", [str(plan), "x", "follower"], started)  # lingers over a message that cannot go
        assert leader.wait(timeout=90) == 0 and leader.stdout.read().strip() == "nothing"
    finally:
        for process in started:
            if process.poll() is None:
                process.kill()
            process.wait(timeout=30)
