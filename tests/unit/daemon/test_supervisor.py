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
from kvasir.daemon.supervisor import EVERY, Failure, Instance, OpenError, RingSupervisor
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


def child(role, index=0, instance="") -> Child:
    return Child(ChildId(role, index, instance=instance), StandInProcess(), Commands())  # type: ignore[arg-type]


@dataclass
class Hosts:
    absent: list[str] = field(default_factory=list)
    lost: str | None = None
    away: set[str] = field(default_factory=set)  # standby or drained hosts that are not there

    def missing(self, now: float) -> str | None:
        return self.lost

    def silent_host(self, host: str, now: float) -> str | None:
        return None

    def available(self, hosts: frozenset[str]) -> bool:
        return not hosts & (self.away | set(self.absent))

    def parks(self, hosts: frozenset[str]) -> bool:
        return bool(hosts & self.away)


@dataclass
class Recorder:
    """The launcher's side, recorded: what was spawned, killed, opened and said."""

    hosts: Hosts | None = None
    spawned: list[list[ChildId]] = field(default_factory=list)
    killed: list[str] = field(default_factory=list)
    opened: list[tuple[str, int, bool]] = field(default_factory=list)
    downs: list[tuple[str, str]] = field(default_factory=list)
    parks: list[str] = field(default_factory=list)
    regrouped: list[tuple[list[str], str]] = field(default_factory=list)
    said: list[str] = field(default_factory=list)
    open_fails: bool = False
    bridge_files_removed: int = 0

    def spawn_children(self, wanted: list[ChildId]) -> list[Child]:
        self.spawned.append(list(wanted))
        return [child(c.role, c.index, c.instance) for c in wanted]

    def kill(self, children: list[Child]) -> None:
        for c in children:
            c.process.kill()
            self.killed.append(c.name)

    def open(self, instance: str, restarts: int, new_bridge: bool, deadline: float) -> None:
        if self.open_fails:
            raise OpenError("the bridge did not bind the client endpoint")
        self.opened.append((instance, restarts, new_bridge))

    def ring_down(self, instance: str, reason: str) -> None:
        self.downs.append((instance, reason))

    def parked(self, instance: str) -> None:
        self.parks.append(instance)

    def regroup(self, children: list[Child], pool: str) -> None:
        self.regrouped.append(([c.name for c in children], pool))

    def bridge_gone(self) -> None:
        self.bridge_files_removed += 1

    def status(self, text: str) -> None:
        self.said.append(text)


RING = [ChildId("stage", 0, instance="a"), ChildId("stage", 1, instance="a"), ChildId("shard", 0, instance="a")]
OTHER = [ChildId("stage", 2, instance="b"), ChildId("stage", 3, instance="b")]


def supervisor(plumbing: Recorder, max_restarts: int = 3, fleet: bool = False, pools=("", "")) -> RingSupervisor:
    instances = [("a", pools[0], RING)] + ([("b", pools[1], OTHER)] if fleet else [])
    ring = RingSupervisor(
        [
            Instance(name, pool, list(ids), RestartPolicy(max_restarts, window_s=60.0, backoff_s=1.0))  # type: ignore[arg-type]
            for name, pool, ids in instances
        ],
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


def failure(ring: RingSupervisor, now: float) -> Failure:
    found = ring.failure(now)
    assert found is not None
    return found


def test_children_are_typed_ids_named_as_their_sockets():
    assert [c.name for c in RING] == ["stage-0", "stage-1", "shard-0"] and BRIDGE.name == "bridge"
    assert ChildId("stage", 2, pool="decode") == ChildId("stage", 2)  # the pool follows from the index
    assert ChildId("stage", 2, instance="b") == ChildId("stage", 2)  # and so does the instance


def test_start_up_spawns_the_instances_then_the_bridge_and_opens_once_all_are_ready():
    plumbing = Recorder()
    ring = supervisor(plumbing, fleet=True)
    assert plumbing.spawned == [RING, OTHER, [BRIDGE]] and plumbing.opened == [(EVERY, 0, True)]
    assert ring.settled and ring.serving and ring.ready and not ring.new_bridge


def test_a_worker_that_dies_is_reported_and_its_instance_restarts_after_the_back_off():
    plumbing = Recorder()
    ring = supervisor(plumbing)
    a = ring.instance("a")
    a.children[1].process.returncode = -signal.SIGKILL
    found = failure(ring, 1.0)
    assert found.reason.startswith("stage-1 (pid ") and found.reason.endswith("killed by signal 9")
    assert found.instances == ("a",)
    assert ring.failed(found, 1.0, serving=True)
    assert plumbing.downs == [("a", found.reason)] and plumbing.killed == ["stage-0", "stage-1", "shard-0"]
    assert a.state == "down" and a.children == [] and ring.bridge is not None  # the bridge lives on
    assert ring.step(1.0) and a.state == "starting"  # the first failure restarts at once
    assert plumbing.spawned[-1] == RING  # the instance, not the bridge
    assert ring.step(2.0) and a.state == "starting"  # not ready yet
    ready(ring, 3.0)
    assert ring.step(3.0) and a.state == "up" and ring.restarts == 1
    assert plumbing.opened[-1] == ("a", 1, False) and plumbing.said[-1] == "a serving again; restarted 1 times"
    a.children[0].process.returncode = 1  # the second failure within the window waits 1 s
    assert ring.failed(failure(ring, 4.0), 4.0, serving=True)
    assert ring.step(4.5) and a.state == "down"
    assert ring.step(5.0) and a.state == "starting"


def test_a_failure_stays_inside_its_instance():
    plumbing = Recorder()
    ring = supervisor(plumbing, max_restarts=1, fleet=True)
    a, b = ring.instance("a"), ring.instance("b")
    b_children = list(b.children)
    a.children[2].process.returncode = 1  # a's expert shard
    found = failure(ring, 1.0)
    assert found.instances == ("a",) and ring.failed(found, 1.0, serving=True)
    assert plumbing.downs == [("a", found.reason)] and b.children == b_children and b.state == "up"
    assert ring.serving and not ring.settled
    ring.step(1.0)
    ready(ring, 2.0)
    ring.step(2.0)
    assert plumbing.opened[-1] == ("a", 1, False) and [c.name for c in a.children] == ["stage-0", "stage-1", "shard-0"]
    a.children[0].process.returncode = 1  # a second failure within the window: a is done for
    assert ring.failed(failure(ring, 3.0), 3.0, serving=True)
    assert a.state == "failed" and ring.settled and ring.serving  # b serves on
    assert ring.step(100.0) and a.children == []
    b.children[0].process.returncode = 1
    assert ring.failed(failure(ring, 101.0), 101.0, serving=True)  # b restarts...
    b.children = ring.plumbing.spawn_children(OTHER)  # type: ignore[attr-defined]
    b.state = "up"
    b.children[1].process.returncode = 1
    assert not ring.failed(failure(ring, 102.0), 102.0, serving=True)  # ...the pool's last instance is done for


def test_a_disaggregated_plans_instances_fail_together():
    plumbing = Recorder()
    ring = supervisor(plumbing, fleet=True, pools=("prefill", "decode"))
    ring.domains = {"a": ("a", "b"), "b": ("a", "b")}
    ring.instance("b").children[0].process.returncode = 1
    found = failure(ring, 1.0)
    assert found.instances == ("a", "b")
    assert ring.failed(found, 1.0, serving=True) and [d[0] for d in plumbing.downs] == ["a", "b"]


def test_a_dead_bridge_takes_every_instance_and_is_replaced_with_them():
    plumbing = Recorder()
    ring = supervisor(plumbing, fleet=True)
    ring.bridge.process.returncode = 1  # type: ignore[union-attr]
    found = failure(ring, 1.0)
    assert found.instances == ("a", "b") and ring.failed(found, 1.0, serving=True)
    assert ring.bridge is None and plumbing.bridge_files_removed == 1 and plumbing.downs == []
    ring.step(1.0)
    assert plumbing.spawned[-3:] == [RING, OTHER, [BRIDGE]] and ring.new_bridge
    ready(ring, 2.0)
    ring.step(2.0)
    assert plumbing.opened[-2:] == [("a", 1, True), ("b", 1, False)] and ring.settled


def test_a_worker_that_hangs_is_killed_and_named():
    plumbing = Recorder()
    ring = supervisor(plumbing)
    for now in (0.5, 1.0, 1.5, 2.0):  # the others keep beating; shard-0 is silent
        ring.note([Heartbeat(c.id.role, c.id.index, c.process.pid) for c in ring.children if c.name != "shard-0"], now)
        assert ring.failure(now) is None
    found = failure(ring, 2.5)
    assert found.reason.startswith("shard-0 (pid ") and "hung: no heartbeat for 2.5 s" in found.reason
    assert plumbing.killed == ["shard-0"] and found.instances == ("a",)


def test_a_missing_host_is_the_failure_and_the_restart_waits_for_it():
    hosts = Hosts()
    plumbing = Recorder(hosts=hosts)
    ring = supervisor(plumbing, fleet=True)
    hosts.lost, hosts.absent = "host b lost: silent for 5.0 s", ["b"]
    ring.instance("b").children[1].process.returncode = -signal.SIGKILL  # the link marks its workers lost
    found = failure(ring, 1.0)
    assert found == Failure("host b lost: silent for 5.0 s", ("b",))
    assert ring.failed(found, 1.0, serving=True)
    spawned = len(plumbing.spawned)
    assert ring.step(100.0) and ring.instance("b").state == "down" and len(plumbing.spawned) == spawned
    hosts.absent = []
    assert ring.step(101.0) and ring.instance("b").state == "starting"


def test_too_many_failures_within_the_window_give_up():
    plumbing = Recorder()
    ring = supervisor(plumbing, max_restarts=1)
    assert ring.failed(Failure("stage-0 exited with code 1", ("a",)), 1.0, serving=True)
    ring.step(1.0)
    assert not ring.failed(Failure("stage-0 exited with code 1", ("a",)), 2.0, serving=True)


def test_children_not_ready_in_time_or_a_bridge_that_cannot_open_count_as_failures():
    plumbing = Recorder()
    ring = supervisor(plumbing)
    ring.failed(Failure("stage-0 exited with code 1", ("a",)), 1.0, serving=True)
    ring.step(1.0)
    assert ring.step(32.0) and ring.instance("a").state == "down"  # 30 s passed, nobody ready: a second failure
    assert ring.last_failure == "not ready after 30 s: stage-0, stage-1, shard-0"
    ring.step(33.0)
    ready(ring, 33.5)
    plumbing.open_fails = True
    assert ring.step(34.0) and ring.instance("a").state == "down"
    assert ring.last_failure == "the bridge did not bind the client endpoint"


def test_a_move_keeps_the_processes_and_a_stage_not_ready_again_in_time_fails_it():
    """A move regroups the instance's own children (no kill, no spawn): it serves in the
    new pool once each stage says Ready again (a shard changes only its stats' pool).
    A stage that does not say it in time fails the instance, which restarts in the new pool."""
    plumbing = Recorder()
    ring = supervisor(plumbing, fleet=True, pools=("prefill", "decode"))
    pids, spawns = [c.process.pid for c in ring.instance("a").children], len(plumbing.spawned)
    ring.move("a", "decode", 1.0)
    a = ring.instance("a")
    assert a.state == "moving" and plumbing.regrouped == [(["stage-0", "stage-1", "shard-0"], "decode")]
    assert [c.ready for c in a.children] == [False, False, True] and a.pool == "decode"
    assert ring.step(2.0) and a.state == "moving"
    ready(ring, 2.5)
    assert ring.step(3.0) and a.state == "up" and a.moves == 1 and a.restarts == 0
    assert [c.process.pid for c in a.children] == pids and plumbing.killed == [] and len(plumbing.spawned) == spawns
    assert plumbing.opened[-1] == ("a", 0, False)
    ring.move("a", "prefill", 4.0)
    assert ring.step(35.0) and a.state == "down"
    assert ring.last_failure == "not ready after 30 s: stage-0, stage-1"
    ring.step(36.5)
    assert [c.pool for c in plumbing.spawned[-1]] == ["prefill"] * 3 and a.state == "starting"


def test_a_failure_while_not_serving_gives_up_at_once():
    """SIGTERM came first (the daemon drains, or is still starting): no restart, nobody told."""
    plumbing = Recorder()
    ring = supervisor(plumbing)
    assert not ring.failed(Failure("stage-1 exited with code 1", ("a",)), 1.0, serving=False)
    assert plumbing.downs == [] and ring.stages == []


def test_messages_from_a_replaced_child_are_ignored():
    plumbing = Recorder()
    ring = supervisor(plumbing)
    old_pid = ring.stages[0].process.pid
    ring.failed(Failure("stage-0 exited with code 1", ("a",)), 1.0, serving=True)
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
    ids = [ChildId("stage", 0, instance="ring"), ChildId("stage", 1, instance="ring")]
    made.ring.instances = [Instance("ring", "", ids, RestartPolicy(3, 60.0))]
    made.ring.instances[0].children = [child("stage", 0, "ring"), child("stage", 1, "ring")]
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
    launcher.ring.instances[0].state = "starting"  # new stages loading after a failure
    launcher.request_stop(signal.SIGTERM)
    launcher.serve()
    assert launcher.state == "stopping" and launcher.exit_code == 0
    for c in launcher.children:
        assert c.command.sent == [Command("stop", "shutting_down")], c.name  # nobody asked to drain
