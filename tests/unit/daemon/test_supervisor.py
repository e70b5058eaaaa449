"""The ring's supervisor as a state machine: stand-in processes, a recording plumbing and a
hand-driven clock; then the launcher's answer to SIGTERM during start-up and during a
restart, with stand-in children."""

from __future__ import annotations

import itertools
import signal
from dataclasses import dataclass, field

import pytest

from kvasir.daemon.children import BRIDGE, Child, ChildId
from kvasir.daemon.supervision import Heartbeats, RestartPolicy
from kvasir.daemon.supervisor import OpenError, RingSupervisor
from kvasir.logs import setup_logging
from kvasir.wire.control import Command, Heartbeat, Ready

PIDS = itertools.count(1000)


@dataclass
class StandInProcess:
    pid: int | None = field(default_factory=lambda: next(PIDS))
    returncode: int | None = None
    killed: bool = False

    def poll(self) -> int | None:
        return self.returncode

    def kill(self) -> None:
        self.killed = True
        self.returncode = -signal.SIGKILL

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = 0  # a stand-in stops when asked
        return self.returncode


@dataclass
class Socket:
    closed: bool = False

    def close(self, linger: int = 0) -> None:
        self.closed = True


@dataclass
class Commands:
    sent: list[Command] = field(default_factory=list)
    socket: Socket = field(default_factory=Socket)

    def send(self, command: Command) -> None:
        self.sent.append(command)


def child(role, index=0) -> Child:
    return Child(ChildId(role, index), StandInProcess(), Commands())  # type: ignore[arg-type]


@dataclass
class Hosts:
    absent: list[str] = field(default_factory=list)
    lost: str | None = None

    def missing(self, now: float) -> str | None:
        return self.lost

    def silent_host(self, host: str, now: float) -> str | None:
        return None


@dataclass
class Recorder:
    """The launcher's side, recorded: what was spawned, killed, opened and said."""

    hosts: Hosts | None = None
    spawned: list[list[ChildId]] = field(default_factory=list)
    killed: list[str] = field(default_factory=list)
    opened: list[tuple[int, bool]] = field(default_factory=list)
    downs: list[str] = field(default_factory=list)
    said: list[str] = field(default_factory=list)
    open_fails: bool = False
    bridge_files_removed: int = 0

    def spawn_children(self, wanted: list[ChildId]) -> list[Child]:
        self.spawned.append(list(wanted))
        return [child(c.role, c.index) for c in wanted]

    def kill(self, children: list[Child]) -> None:
        for c in children:
            c.process.kill()
            self.killed.append(c.name)

    def open(self, restarts: int, new_bridge: bool, deadline: float) -> None:
        if self.open_fails:
            raise OpenError("the bridge did not bind the client endpoint")
        self.opened.append((restarts, new_bridge))

    def ring_down(self, reason: str) -> None:
        self.downs.append(reason)

    def bridge_gone(self) -> None:
        self.bridge_files_removed += 1

    def status(self, text: str) -> None:
        self.said.append(text)


RING = [ChildId("stage", 0), ChildId("stage", 1), ChildId("shard", 0)]


def supervisor(plumbing: Recorder, max_restarts: int = 3) -> RingSupervisor:
    ring = RingSupervisor(
        list(RING),
        RestartPolicy(max_restarts, window_s=60.0, backoff_s=1.0),
        Heartbeats(timeout_s=2.0),
        plumbing,
        ready_s=30.0,
        log=setup_logging("critical", role="test"),
    )
    ring.spawn_missing()
    ready(ring, 0.0)
    ring.open(deadline=30.0)
    return ring


def ready(ring: RingSupervisor, now: float) -> None:
    ring.note([Ready(c.id.role, c.id.index, c.process.pid) for c in ring.children], now)


def test_children_are_typed_ids_named_as_their_sockets():
    assert [c.name for c in RING] == ["stage-0", "stage-1", "shard-0"] and BRIDGE.name == "bridge"
    assert ChildId("stage", 2, pool="decode") == ChildId("stage", 2)  # the pool follows from the index
    assert ChildId("stage", 2, instance=1) != ChildId("stage", 2)


def test_start_up_spawns_the_ring_then_the_bridge_and_opens_once_all_are_ready():
    plumbing = Recorder()
    ring = supervisor(plumbing)
    assert plumbing.spawned == [RING, [BRIDGE]] and plumbing.opened == [(0, True)]
    assert ring.state == "up" and ring.ready and not ring.new_bridge


def test_a_worker_that_dies_is_reported_and_the_ring_restarts_after_the_back_off():
    plumbing = Recorder()
    ring = supervisor(plumbing)
    ring.stages[1].process.returncode = -signal.SIGKILL
    reason = ring.failure(1.0)
    assert reason is not None and reason.startswith("stage-1 (pid ") and reason.endswith("killed by signal 9")
    assert ring.failed(reason, 1.0, serving=True)
    assert plumbing.downs == [reason] and plumbing.killed == ["stage-0", "stage-1", "shard-0"]
    assert ring.state == "down" and ring.stages == [] and ring.bridge is not None  # the bridge lives on
    assert ring.step(1.0) and ring.state == "starting"  # the first failure restarts at once
    assert plumbing.spawned[-1] == RING  # the ring, not the bridge
    assert ring.step(2.0) and ring.state == "starting"  # not ready yet
    ready(ring, 3.0)
    assert ring.step(3.0) and ring.state == "up" and ring.restarts == 1
    assert plumbing.opened[-1] == (1, False) and plumbing.said[-1] == "serving 2 stages; restarted 1 times"
    ring.stages[0].process.returncode = 1  # the second failure within the window waits 1 s
    assert ring.failed(ring.failure(4.0) or "", 4.0, serving=True)
    assert ring.step(4.5) and ring.state == "down"
    assert ring.step(5.0) and ring.state == "starting"


def test_a_dead_bridge_is_replaced_with_the_ring():
    plumbing = Recorder()
    ring = supervisor(plumbing)
    ring.bridge.process.returncode = 1  # type: ignore[union-attr]
    assert ring.failed(ring.failure(1.0) or "", 1.0, serving=True)
    assert ring.bridge is None and plumbing.bridge_files_removed == 1 and plumbing.downs == []
    ring.step(1.0)
    assert plumbing.spawned[-2:] == [RING, [BRIDGE]] and ring.new_bridge
    ready(ring, 2.0)
    ring.step(2.0)
    assert plumbing.opened[-1] == (1, True) and ring.state == "up"


def test_a_worker_that_hangs_is_killed_and_named():
    plumbing = Recorder()
    ring = supervisor(plumbing)
    for now in (0.5, 1.0, 1.5, 2.0):  # the others keep beating; shard-0 is silent
        ring.note([Heartbeat(c.id.role, c.id.index, c.process.pid) for c in ring.children if c.name != "shard-0"], now)
        assert ring.failure(now) is None
    reason = ring.failure(2.5)
    assert reason is not None and reason.startswith("shard-0 (pid ") and "hung: no heartbeat for 2.5 s" in reason
    assert plumbing.killed == ["shard-0"]


def test_a_missing_host_is_the_failure_and_the_restart_waits_for_it():
    hosts = Hosts()
    plumbing = Recorder(hosts=hosts)
    ring = supervisor(plumbing)
    hosts.lost, hosts.absent = "host b lost: silent for 5.0 s", ["b"]
    assert ring.failure(1.0) == "host b lost: silent for 5.0 s"
    assert ring.failed("host b lost: silent for 5.0 s", 1.0, serving=True)
    spawned = len(plumbing.spawned)
    assert ring.step(100.0) and ring.state == "down" and len(plumbing.spawned) == spawned  # waits for kvasird join
    hosts.absent = []
    assert ring.step(101.0) and ring.state == "starting"


def test_too_many_failures_within_the_window_give_up():
    plumbing = Recorder()
    ring = supervisor(plumbing, max_restarts=1)
    assert ring.failed("stage-0 exited with code 1", 1.0, serving=True)
    ring.step(1.0)
    assert not ring.failed("stage-0 exited with code 1", 2.0, serving=True)


def test_children_not_ready_in_time_or_a_bridge_that_cannot_open_count_as_failures():
    plumbing = Recorder()
    ring = supervisor(plumbing)
    ring.failed("stage-0 exited with code 1", 1.0, serving=True)
    ring.step(1.0)
    assert ring.step(32.0) and ring.state == "down"  # 30 s passed, nobody ready: killed, a second failure
    assert ring.last_failure == "not ready after 30 s: stage-0, stage-1, shard-0"
    ring.step(33.0)
    ready(ring, 33.5)
    plumbing.open_fails = True
    assert ring.step(34.0) and ring.state == "down"
    assert ring.last_failure == "the bridge did not bind the client endpoint"


def test_a_failure_while_not_serving_gives_up_at_once():
    """SIGTERM came first (the daemon drains, or is still starting): no restart, nobody told."""
    plumbing = Recorder()
    ring = supervisor(plumbing)
    assert not ring.failed("stage-1 exited with code 1", 1.0, serving=False)
    assert plumbing.downs == [] and ring.stages == []


def test_messages_from_a_replaced_child_are_ignored():
    plumbing = Recorder()
    ring = supervisor(plumbing)
    old_pid = ring.stages[0].process.pid
    ring.failed("stage-0 exited with code 1", 1.0, serving=True)
    ring.step(1.0)
    ring.note([Ready("stage", 0, old_pid)], 1.5)
    assert not ring.stages[0].ready


# -- the launcher's answer to SIGTERM ---------------------------------------------------------
@pytest.fixture
def launcher(tiny_models, tmp_path):
    from kvasir.config.plan import load_plan
    from kvasir.daemon.launcher import Launcher
    from kvasir.model.source import resolve_source
    from tests.support.daemon import write_plan

    plan = load_plan(write_plan(tmp_path / "plan.toml", tiny_models["llama"], [(0, 3), (3, 6)]))
    made = Launcher(plan, resolve_source(str(tiny_models["llama"])), tmp_path / "rt", setup_logging("critical"))
    made.ring.stages = [child("stage", 0), child("stage", 1)]
    made.ring.bridge = child("bridge")
    yield made
    made.sockets.end()


def test_sigterm_during_start_up_stops_before_serving(launcher):
    from kvasir.daemon.launcher import StartInterrupted

    launcher.request_stop(signal.SIGTERM)
    assert launcher.state == "draining"
    with pytest.raises(StartInterrupted, match="stopped during start-up"):
        launcher.wait_ready()  # the children are not ready: the stop is seen first


def test_sigterm_during_a_restart_stops_everything_without_draining(launcher):
    for c in launcher.children:
        c.ready = True
    launcher.state = "running"
    launcher.ring.state = "starting"  # new stages loading after a failure
    launcher.request_stop(signal.SIGTERM)
    launcher.serve()
    assert launcher.state == "stopping" and launcher.exit_code == 0
    for c in launcher.children:
        assert c.command.sent == [Command("stop", "shutting_down")], c.name  # nobody asked to drain
