"""The launcher's link to its followers (kvasir/daemon/remote.py), over real CURVE
sockets on loopback: a host is who its key says, never who its name says; reports about
an older set of workers are ignored; starting the bridge alone leaves the ring's remote
workers as they are; stopping a worker stops that one; a standby or drained host is not
waited for, and a drained one is back only under a new kvasird join."""

from __future__ import annotations

import os
import time

import msgspec
import pytest
import zmq

from kvasir.config.keys import generate, load_pair
from kvasir.daemon.children import ChildId
from kvasir.daemon.layout import Layout
from kvasir.daemon.remote import Cluster, RemoteProcess
from kvasir.daemon.resolve import resolve_plan
from kvasir.logs import setup_logging
from kvasir.transport.channels import Endpoints
from kvasir.transport.curve import Fabric
from kvasir.transport.fabric import Sockets
from kvasir.transport.routes import plan_digest
from kvasir.wire.control import StageSettings
from kvasir.wire.hosts import Alive, Exited, Spawned
from tests.support.daemon import free_port

MODEL = "unconverted/float32"  # the served model's identity (kvasir/model/fingerprint.py)


@pytest.fixture
def leader(tmp_path, tiny_models):
    generate(tmp_path / "keys", [], ["a", "b", "c"])
    plan_path = tmp_path / "plan.toml"
    plan_path.write_text(
        f'[model]\nsource = "{tiny_models["llama"]}"\nmax_seq_len = 64\n[cluster]\nleader = "a"\nkeys = "keys"\n'
        f'[hosts.a]\naddress = "127.0.0.1"\nport = {free_port()}\n'
        f'[hosts.b]\naddress = "127.0.0.2"\nport = {free_port()}\n[hosts.c]\naddress = "127.0.0.3"\nstandby = true\n'
        '[[stages]]\nlayers = [0, 3]\n[[stages]]\nlayers = [3, 6]\nhost = "b"\n'
    )
    plan, _ = resolve_plan(plan_path)
    cluster = Cluster.of(plan)
    sockets = Sockets(
        zmq.Context(), Endpoints(tmp_path / "rt", cluster.routes), Fabric.of(cluster.routes, cluster.keys)
    )
    link = cluster.link(sockets, plan, setup_logging("warning"), None)
    followers = []

    def follower(key_of: str, named: str) -> zmq.Socket:
        sock = sockets.ctx.socket(zmq.DEALER)
        sock.routing_id = named.encode()
        sock.curve_publickey, sock.curve_secretkey = load_pair(tmp_path / "keys" / f"{key_of}.key_secret")
        sock.curve_serverkey = cluster.keys.hosts["a"]
        sock.connect(sockets.ends.hosts)
        followers.append(sock)
        return sock

    yield link, follower, plan_digest(plan, cluster.routes), cluster, plan
    for sock in followers:
        sock.close(linger=0)
    sockets.end()


def send(sock: zmq.Socket, message) -> None:
    sock.send(msgspec.msgpack.encode(message))


def settle(link, until, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not until() and time.monotonic() < deadline:
        link.receive(50)


def joined_with_stage(leader) -> tuple:
    """Host b joined; the link, b's socket, and the settings of stage 1 (on b)."""
    link, follower, digest, cluster, plan = leader
    b = follower("b", "b")
    send(b, Alive("b", 1, digest, MODEL))
    settle(link, lambda: "b" in link.followers)
    worker = StageSettings(
        index=1, plan=plan, runtime_dir="/x", launcher_pid=os.getpid(), edges=[], first=0, fabric=cluster.fabric("b")
    )
    return link, b, worker


def test_a_host_is_who_its_key_says(leader):
    link, follower, digest, _, _ = leader
    impostor = follower("c", "b")  # c's key (a listed host), b's name
    send(impostor, Alive("b", 4242, digest, MODEL))
    honest = follower("b", "b")
    send(honest, Alive("b", os.getpid(), digest, MODEL))
    settle(link, lambda: "b" in link.followers)
    assert link.followers["b"].pid == os.getpid()  # the impostor's word never counted
    assert link.absent == []


def test_reports_about_older_workers_are_ignored_and_the_bridge_alone_changes_nothing(leader):
    link, b, worker = joined_with_stage(leader)
    children = link.start([worker], Layout(), "kvasir-1-00000000")
    process = children[ChildId("stage", 1)].process
    assert isinstance(process, RemoteProcess) and process.generation == link.generation == 1
    assert link.start([], Layout(), "kvasir-1-00000000") == {} and link.generation == 1  # the bridge alone
    send(b, Exited(0, "stage-1", 99, -9, "an older ring's"))
    send(b, Spawned(1, "stage-1", 1234))
    settle(link, lambda: process.pid is not None)
    assert process.pid == 1234 and process.poll() is None
    send(b, Exited(1, "stage-1", 1234, 1, ""))
    settle(link, lambda: process.poll() is not None)
    assert process.poll() == 1
    children[ChildId("stage", 1)].command.socket.close(linger=0)


def test_a_follower_whose_plan_differs_is_refused(leader):
    from kvasir.wire.hosts import LeaderMessage, Refused

    link, follower, digest, _, _ = leader
    b = follower("b", "b")
    send(b, Alive("b", 7, "0" * 16, MODEL))
    settle(link, lambda: b.poll(0))
    answer = msgspec.msgpack.decode(b.recv(), type=LeaderMessage)
    assert isinstance(answer, Refused) and "host b's plan differs from the leader's" in answer.reason
    assert "b" not in link.followers and link.absent == ["b"]
    c = follower("c", "c")
    send(c, Alive("c", 8, digest, "fedcba9876543210/float32"))  # the same layout, other weights
    settle(link, lambda: c.poll(0))
    answer = msgspec.msgpack.decode(c.recv(), type=LeaderMessage)
    assert isinstance(answer, Refused) and "host c serves another model than the leader" in answer.reason
    assert "c" not in link.followers


def test_a_follower_whose_connection_drops_is_lost_after_the_grace_unless_it_speaks_again(leader):
    from kvasir.transport.resets import IN_FLIGHT_S, RECONNECT_GRACE_S

    link, follower, digest, _, _ = leader
    b, c = follower("b", "b"), follower("c", "c")
    send(b, Alive("b", 1, digest, MODEL))
    send(c, Alive("c", 2, digest, MODEL))
    settle(link, lambda: {"b", "c"} <= set(link.followers))
    b.close(linger=0)  # b's processes died: its kernel reset the connection
    deadline = time.monotonic() + 30
    while link.resets.latest() == 0.0 and time.monotonic() < deadline:
        time.sleep(0.02)
    dropped = link.resets.latest()
    assert dropped > 0.0  # the monitor said a connection dropped (not whose)
    time.sleep(max(0.0, dropped + IN_FLIGHT_S - time.monotonic()) + 0.05)
    send(c, Alive("c", 2, digest, MODEL))  # c is alive and says so within the grace
    settle(link, lambda: link.followers["c"].heard > dropped + IN_FLIGHT_S)
    assert link.missing(dropped + RECONNECT_GRACE_S / 2) is None and "b" in link.followers  # within the grace
    assert link.timeout_s > 2 * RECONNECT_GRACE_S  # what follows is the drop, not the silence timeout
    link.missing(dropped + RECONNECT_GRACE_S + 0.1)
    assert "b" not in link.followers and "c" in link.followers


def test_stopping_a_worker_names_it_and_forgets_what_its_follower_says_of_it(leader):
    from kvasir.wire.hosts import LeaderMessage, Stop

    link, b, worker = joined_with_stage(leader)
    children = link.start([worker], Layout(), "kvasir-1-00000000")
    child = children[ChildId("stage", 1)]
    child.process.kill()
    said = []
    deadline = time.monotonic() + 10
    while not any(isinstance(m, Stop) for m in said) and time.monotonic() < deadline:
        if b.poll(100):
            said.append(msgspec.msgpack.decode(b.recv(), type=LeaderMessage))
    kinds = [type(m).__name__ for m in said]
    assert kinds == ["Halt", "Ping", "Run", "Stop"], kinds  # a host that joins runs nothing of an older leader's
    assert said[3].names == ["stage-1"]
    assert "stage-1" not in link.processes and child.process.poll() is not None
    child.command.socket.close(linger=0)


def test_standby_and_drained_hosts_are_not_waited_for_and_a_drained_one_returns_under_a_new_join(leader):
    link, follower, digest, _, _ = leader
    assert link.needed == {"b"} and link.absent == ["b"]  # c is standby
    b, c = follower("b", "b"), follower("c", "c")
    send(c, Alive("c", 5, digest, MODEL))
    settle(link, lambda: "c" in link.followers)
    assert link.available(frozenset({"c"})) and not link.parks(frozenset({"c"}))
    assert not link.available(frozenset({"b", "c"})) and not link.parks(frozenset({"b"}))  # b is needed: waited for
    link.drain("c")
    assert not link.available(frozenset({"c"})) and link.parks(frozenset({"c"}))
    send(c, Alive("c", 5, digest, MODEL))  # the same kvasird join: still drained
    settle(link, lambda: False, timeout_s=0.3)
    assert link.parks(frozenset({"c"}))
    send(c, Alive("c", 6, digest, MODEL))  # started anew
    settle(link, lambda: link.followers["c"].pid == 6)
    assert link.available(frozenset({"c"})) and link.needed == {"b"}
    link.drain("b")  # a needed host drained while away: no longer waited for
    assert link.absent == [] and link.parks(frozenset({"b"}))
    send(b, Alive("b", 7, digest, MODEL))
    settle(link, lambda: "b" in link.followers)
    assert link.needed == {"b"} and link.available(frozenset({"b"}))
