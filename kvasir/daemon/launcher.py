"""The launcher (``kvasird start``): spawn, readiness, shutdown, and the plumbing the
ring's supervisor (kvasir/daemon/supervisor.py) acts through.

Shutdown is a small state machine — running -> draining -> stopping -> stopped — and a
signal only moves the state; the loop does the work.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import zmq

from kvasir.config.plan import Plan
from kvasir.config.sections import Pool
from kvasir.daemon.children import Child, ChildId, join_children
from kvasir.daemon.forks import Zygote
from kvasir.daemon.fronts import FrontError, Fronts
from kvasir.daemon.instances import EVERY, Failure, OpenError, plan_instances
from kvasir.daemon.layout import Layout, LayoutError, lay_out
from kvasir.daemon.notify import ServiceNotifier
from kvasir.daemon.remote import Cluster, HostLink
from kvasir.daemon.spawner import Spawner
from kvasir.daemon.supervision import Heartbeats
from kvasir.daemon.supervisor import RingSupervisor
from kvasir.errors import KvasirError
from kvasir.logs import Logger
from kvasir.model.source import ModelSource
from kvasir.ring.handshake import HandleExchange, HandshakeError
from kvasir.ring.shm import make_pool_folder, remove_pool_folder, sweep_stale_segments
from kvasir.transport.channels import Endpoints, PullChannel
from kvasir.transport.curve import Fabric
from kvasir.transport.fabric import Sockets
from kvasir.transport.rundir import RuntimeDirError, lock_runtime_dir
from kvasir.wire.control import (
    Command,
    ControlMessage,
    Drained,
    EdgeHandles,
    Heartbeat,
    Ready,
    Regroup,
)

DaemonPhase = Literal["starting", "running", "draining", "stopping", "stopped"]


class LaunchError(KvasirError):
    """The daemon could not start: the runtime dir is taken, or a child failed to come up."""


class StartInterrupted(KvasirError):
    """SIGTERM or SIGINT arrived before every child was ready."""


@dataclass
class Timeouts:
    ready_s: float = 300.0
    drain_s: float = 30.0
    stop_s: float = 10.0


@dataclass
class Launcher:
    """Spawns the stages and the bridge, owns start-up and shutdown, and carries out what
    the ring's supervisor decides (``self.ring``: its children and restarts).

    ``state`` is the daemon's: starting -> running -> draining -> stopping -> stopped.
    """

    plan: Plan
    source: ModelSource
    runtime_dir: Path
    log: Logger
    timeouts: Timeouts = field(default_factory=Timeouts)
    stats_interval_s: float = 0.5
    log_level: str = "info"
    state: DaemonPhase = "starting"
    exit_code: int = 0
    notifier: ServiceNotifier = field(default_factory=lambda: ServiceNotifier(None))
    parent_pid: int | None = None  # stop (drain) once this process is no longer the parent
    cluster: Cluster | None = None  # a plan across hosts (kvasir/daemon/remote.py)
    zygote: Zygote | None = None  # forks the local workers (kvasir/daemon/zygote.py)

    def __post_init__(self) -> None:
        cluster = self.cluster
        self.ends = Endpoints(self.runtime_dir, cluster.routes if cluster else None)
        fabric = Fabric.of(cluster.routes, cluster.keys) if cluster else None
        self.sockets = Sockets(zmq.Context(), self.ends, fabric)
        self.spawner = Spawner(
            self.plan,
            self.source,
            self.runtime_dir,
            self.sockets,
            cluster,
            self.stats_interval_s,
            self.log_level,
            self.log,
            zygote=self.zygote,
        )
        sup = self.plan.supervise
        self.fronts = Fronts(
            self.plan.http,
            self.sockets,
            self.spawner.front,
            sup.heartbeat_timeout_s,
            sup.restart_window_s,
            self.log,
            zygote=self.zygote,
        )
        self.layout = Layout()  # edges and KV segments, made by prepare()
        self.exchange = HandleExchange({})  # CUDA IPC edges' handles, paired at each start
        self._lock_fd: int | None = None
        self._control: PullChannel | None = None
        heartbeats = Heartbeats(sup.heartbeat_timeout_s)
        self.ring = RingSupervisor([], heartbeats, self, self.timeouts.ready_s, self.log)
        self._absent: tuple[str, ...] = ()  # the missing hosts the bridge was last told of

    @property
    def hosts(self) -> HostLink | None:
        """The followers' link (a plan across hosts, once prepare() bound it)."""
        return self.spawner.hosts

    @property
    def children(self) -> list[Child]:
        return self.ring.children

    # -- start-up ------------------------------------------------------------------------
    def prepare(self) -> None:
        """Make the runtime dir (0700), take its lock, clear stale sockets, create the edges."""
        try:
            self._lock_fd = lock_runtime_dir(self.runtime_dir)
        except RuntimeDirError as exc:
            raise LaunchError(str(exc)) from None
        for stale in self.ends.socket_files():  # only Kvasir's names (make_runtime_dir checked)
            stale.unlink(missing_ok=True)
        self._sweep()
        self._pool_folder()
        self._control = PullChannel(self.sockets.bind(zmq.PULL, self.ends.control), ControlMessage, self.log)
        try:
            self.fronts.bind()
        except FrontError as exc:
            raise LaunchError(str(exc)) from None
        if self.cluster is not None:
            self.spawner.hosts = self.cluster.link(self.sockets, self.plan, self.log, self.source.weights_dir)
        try:
            self.layout = lay_out(self.plan, self.source, self.spawner.prefix, self.log)
        except LayoutError as exc:
            raise LaunchError(str(exc)) from None
        self.exchange = HandleExchange(self.layout.ipc_edges)
        self._watch_instances()

    def _watch_instances(self) -> None:
        """The supervisor's instances, each with its own restart window, and their failure domains."""
        self.ring.instances, self.ring.domains = plan_instances(self.plan, self.layout.ring_ids())

    def spawn(self) -> None:
        """Start every child (the stages, their expert shards, the bridge) and the HTTP fronts."""
        self.ring.spawn_missing()
        if self.state == "starting" and not self.fronts.running:
            self.fronts.start()  # up while the stages load: /health answers 503 until the ring serves

    def wait_hosts(self) -> None:
        """A plan across hosts: wait (as long as for readiness) for every follower to join."""
        deadline = time.monotonic() + self.timeouts.ready_s
        while self.hosts is not None and self.hosts.absent:
            if time.monotonic() > deadline:
                raise LaunchError(f"hosts {', '.join(self.hosts.absent)} did not join: start `kvasird join` there")
            self._pulse("while waiting for hosts")
            self.notifier.status(f"waiting for hosts {', '.join(self.hosts.absent)} to join")
            self.hosts.receive(100)
            self.hosts.tick(time.monotonic())

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.timeouts.ready_s
        while not (self.ring.ready and self.fronts.ready):
            if time.monotonic() > deadline:
                late = [c.name for c in [*self.children, *self.fronts.running.values()] if not c.ready]
                raise LaunchError(f"not ready after {self.timeouts.ready_s:.0f} s: {', '.join(late)}")
            failure = self.ring.lost(time.monotonic()) or self.fronts.exited()
            if failure is not None:
                raise LaunchError(f"{failure} during start-up")
            self._pulse("during start-up")
            self._note(self._control_messages(100))
        try:
            self.ring.open(deadline)
        except OpenError as exc:
            raise LaunchError(f"{exc} during start-up") from None
        if self.state == "starting":  # a SIGTERM that came during open stands: serve() drains at once
            self.state = "running"
        self.notifier.ready(f"serving {len(self.layout.places)} stages from {self.runtime_dir}")

    def _pulse(self, doing: str) -> None:
        """While starting: stop as on SIGTERM once the parent is gone; ping the watchdog."""
        self._watch_parent()
        if self.state == "draining":
            raise StartInterrupted(f"stopped {doing}")
        self.notifier.watchdog()

    def _note(self, messages: list) -> None:
        """Fronts' readiness and heartbeats to the fronts, the ring's to its supervisor;
        CUDA IPC halves from current stages passed on."""
        now = time.monotonic()
        ring = []
        for message in messages:
            if isinstance(message, (Ready, Heartbeat)) and message.role == "front":
                self.fronts.note(message, now)
            elif isinstance(message, Regroup) and self.state == "running":
                self._regroup(message, now)
            elif isinstance(message, (Ready, Heartbeat, EdgeHandles)):
                ring.append(message)
        for half in self.ring.note(ring, now):
            self._pass_handles(half)

    def _regroup(self, message: Regroup, now: float) -> None:
        """The bridge says a moving instance is empty: restart it in its new pool, if the
        plan lets it serve there, or park it (its host is drained)."""
        place = next((p for p in self.layout.places if p.instance == message.instance), None)
        instance = next((i for i in self.ring.instances if i.name == message.instance), None)
        if message.drain and self.hosts is not None and instance is not None and message.drain in instance.hosts:
            self.hosts.drain(message.drain)
            self.ring.park(message.instance)
        elif place is None or message.drain or message.pool not in place.views:
            self.log.warning(
                "dropped a move the plan does not allow",
                instance=message.instance,
                pool=message.pool,
                drain=message.drain,
            )
        else:
            self.ring.move(message.instance, message.pool, now)

    def _pass_handles(self, half: EdgeHandles) -> None:
        """A stage's CUDA IPC handles: once both sides of its edge sent theirs, each gets the other's."""
        try:
            for target, other in self.exchange.offer(half):
                stage = next(c for c in self.ring.stages if c.id == ChildId("stage", target))
                stage.command.send(Command("attach", handles=(other,)))
        except HandshakeError as exc:
            self.log.error("bad CUDA IPC handles", error=str(exc))  # the stage waits in vain: its start-up times out

    # -- the supervisor's plumbing ----------------------------------------------------------
    def open(self, instance: str, restarts: int, new_bridge: bool, deadline: float) -> None:
        """An instance's children (EVERY: all of them) are ready: the bridge routes requests
        to it (a new bridge binds the client endpoint first, and binding an ipc socket makes
        its file)."""
        bridge = self.ring.bridge
        if bridge is None:
            raise OpenError("no bridge to open")
        for ring in self.ring.instances:
            if ring.state == "parked" and (instance == EVERY or new_bridge):
                bridge.command.send(Command("parked", instance=ring.name))
            elif instance in (EVERY, ring.name):
                pids = tuple(c.process.pid for c in ring.children if c.process.pid is not None)
                last = self.ring.last_failure
                bridge.command.send(
                    Command("serve", message=last, restarts=restarts, pids=pids, instance=ring.name, pool=ring.pool)
                )
        while new_bridge and not self.ends.client_path.exists():
            if bridge.process.poll() is not None:
                raise OpenError(f"{bridge.name} exited with code {bridge.process.returncode}")
            if time.monotonic() > deadline + 10:
                raise OpenError("the bridge did not bind the client endpoint")
            time.sleep(0.01)

    def spawn_children(self, wanted: list[ChildId]) -> list[Child]:
        if any(child.role == "stage" for child in wanted):
            self.exchange.clear()  # a new ring's stages pair their CUDA IPC edges afresh
        return self.spawner.start(self.layout, wanted)

    def regroup(self, children: list[Child], pool: Pool) -> None:
        self.spawner.regroup(self.layout, children, pool)

    def parked(self, instance: str) -> None:
        if self.ring.bridge is not None:
            self.ring.bridge.command.send(Command("parked", instance=instance))

    def ring_down(self, instance: str, reason: str) -> None:
        if self.ring.bridge is not None:
            self.ring.bridge.command.send(Command("ring_down", "stage_failed", reason, instance=instance))

    def bridge_gone(self) -> None:
        for path in self.ends.bridge_files():
            path.unlink(missing_ok=True)

    def status(self, text: str) -> None:
        self.notifier.status(text)

    def kill(self, children: list[Child]) -> None:
        for child in children:
            if child.process.poll() is None:
                child.process.kill()
        for child in children:
            child.process.wait()
            child.command.socket.close(linger=0)
        self._sweep()

    # -- serving --------------------------------------------------------------------------
    def request_stop(self, signum: int, _frame=None) -> None:
        """Signal handler: only moves the state."""
        if self.state in ("starting", "running"):
            self.state = "draining"

    def _watch_parent(self) -> None:
        """With ``parent_pid``: the process that started the daemon is gone, so stop as on SIGTERM."""
        if self.parent_pid is not None and self.state in ("starting", "running") and os.getppid() != self.parent_pid:
            self.log.warning("the process that started kvasird is gone: stopping", parent=self.parent_pid)
            self.state = "draining"

    def serve(self) -> None:
        self.log.info("serving", runtime_dir=str(self.runtime_dir), stages=len(self.layout.places))
        drain_deadline = None
        while self.state in ("running", "draining"):
            self._watch_parent()
            # heartbeats that are already here are read before anyone is judged silent
            messages = self._control_messages(100)
            self._note(messages)
            failure = self.ring.failure(time.monotonic())
            if failure is not None:
                self._failed(failure)
                continue
            self.notifier.watchdog()
            self.fronts.check(time.monotonic())
            if not self.ring.settled and self.state == "running" and not self.ring.step(time.monotonic()):
                self._give_up(self.ring.last_failure)
                continue
            if self.state == "draining":
                drain_deadline = self._drain_step(messages, drain_deadline)

    def _drain_step(self, messages: list, deadline: float | None) -> float | None:
        """Draining: ask the bridge once, then stop when it has drained or the time is up."""
        bridge = self.ring.bridge
        if bridge is None or not bridge.ready or not self.ring.serving:
            self.log.info("stopping while every instance restarts: nothing to drain")
            self._stop_all("shutting_down")
            return deadline
        if deadline is None:
            self.log.info("draining", timeout_s=self.timeouts.drain_s)
            self.notifier.stopping(f"draining: up to {self.timeouts.drain_s:g} s for running requests")
            bridge.command.send(Command("drain"))
            return time.monotonic() + self.timeouts.drain_s
        if any(isinstance(m, Drained) for m in messages):
            self.log.info("drained")
            self._stop_all("shutting_down")
        elif time.monotonic() > deadline:
            self.log.warning("drain timeout: ending the requests still running")
            self._stop_all("shutting_down")
        return deadline

    def _failed(self, failure: Failure) -> None:
        # Read once: SIGTERM may arrive while this runs (killing children takes time),
        # and a failure noticed before the stop request is handled as one, consistently.
        serving = self.state == "running"
        if not self.ring.failed(failure, time.monotonic(), serving):
            self._give_up(failure.reason)

    def _give_up(self, reason: str) -> None:
        self.notifier.stopping(f"stopping: {reason}")
        self.exit_code = 1
        self._stop_all("stage_failed")

    def _control_messages(self, timeout_ms: int) -> list:
        if self._control is None:  # before prepare()
            return []
        if self.hosts is not None:
            self.hosts.receive()
            self.hosts.tick(time.monotonic())
            self._report_hosts(tuple(self.hosts.absent))
        if self._control.socket.poll(timeout_ms):
            return self._control.drain()
        return []

    def _report_hosts(self, absent: tuple[str, ...]) -> None:
        """Tell the bridge (for its stats) which hosts are missing, when that changes."""
        bridge = self.ring.bridge
        if absent != self._absent and bridge is not None and bridge.ready:
            bridge.command.send(Command("hosts", hosts=absent))
            self._absent = absent

    def _pool_folder(self) -> None:
        """The KV pool's memory tier, made fresh before any other file of the daemon's prefix."""
        pool = self.plan.kv_pool
        if pool is None or pool.host_bytes == 0:
            return
        try:
            made = make_pool_folder(self.spawner.prefix, pool.host_bytes)
        except KvasirError as exc:
            raise LaunchError(str(exc)) from None
        if not made:
            self.log.error("the KV pool's memory tier folder existed before the daemon made it: its stages check it")

    def _sweep(self) -> None:
        """Remove shared memory whose creator is gone (killed children's, a killed daemon's)."""
        for path, size in sweep_stale_segments():
            self.log.warning("removed stale shared memory", file=str(path), bytes=size)

    def _stop_all(self, code: str) -> None:
        self.state = "stopping"
        bridge = self.ring.bridge
        if bridge is not None and bridge.process.poll() is None:
            bridge.command.send(Command("stop", code))
            join_children(self.log, [bridge], self.timeouts.stop_s)
        self.fronts.stop(self.timeouts.stop_s)  # after the bridge: its last events reach HTTP clients
        # stages before their expert shards: a stage may need its shards to finish a batch
        stages = self.ring.stages
        for group in ([c for c in stages if c.id.role == "stage"], stages):
            for child in group:
                if child.process.poll() is None:
                    child.command.send(Command("stop", code))
            join_children(self.log, group, self.timeouts.stop_s)

    # -- cleanup --------------------------------------------------------------------------
    def cleanup(self) -> None:
        """Stop whatever still runs, remove sockets, shared memory and the lock."""
        self.ring.kill(self.children)  # and sweep their shared memory
        if self.zygote is not None:
            self.zygote.close()
        self.fronts.close()
        if self.hosts is not None:
            self.hosts.halt_all("the leader stops")
        self.layout.close()
        remove_pool_folder(self.spawner.prefix)  # the KV pool's host memory tier
        self.sockets.end()
        if self._lock_fd is not None:
            for sock in self.ends.socket_files():
                sock.unlink(missing_ok=True)
            (self.runtime_dir / "kvasird.lock").unlink(missing_ok=True)
            os.close(self._lock_fd)
            self._lock_fd = None
        self.state = "stopped"
