"""The launcher (``kvasird start``): spawn, readiness, supervision, shutdown.

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
from kvasir.daemon.children import Child, ending, join_children
from kvasir.daemon.fronts import FrontError, Fronts
from kvasir.daemon.layout import Layout, LayoutError, lay_out
from kvasir.daemon.notify import ServiceNotifier
from kvasir.daemon.remote import Cluster, HostLink, RemoteProcess
from kvasir.daemon.spawner import Spawner
from kvasir.daemon.supervision import Heartbeats, RestartPolicy
from kvasir.errors import KvasirError
from kvasir.logs import Logger
from kvasir.model.source import ModelSource
from kvasir.ring.handshake import HandleExchange, HandshakeError
from kvasir.ring.shm import sweep_stale_segments
from kvasir.transport.channels import Endpoints, PullChannel
from kvasir.transport.curve import Fabric
from kvasir.transport.fabric import Sockets
from kvasir.transport.rundir import RuntimeDirError, lock_runtime_dir
from kvasir.wire.base import Role
from kvasir.wire.control import (
    Command,
    ControlMessage,
    Drained,
    EdgeHandles,
    Heartbeat,
    Ready,
)

DaemonPhase = Literal["starting", "running", "draining", "stopping", "stopped"]
RingState = Literal["up", "down", "starting"]  # the children, while the daemon runs


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
    """Spawns the stages and the bridge, supervises them, and owns shutdown and restart.

    ``state`` is the daemon's: starting -> running -> draining -> stopping -> stopped.
    ``ring`` is the children's while running: "up"; "down" after a failure (every
    request told, the stages killed, a restart waiting out its back-off); "starting"
    (new children loading). A failed bridge is restarted with the stages.
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
        )
        self.stages: list[Child] = []
        self.bridge: Child | None = None
        sup = self.plan.supervise
        self.fronts = Fronts(
            self.plan.http, self.sockets, self.spawner.front, sup.heartbeat_timeout_s, sup.restart_window_s, self.log
        )
        self.layout = Layout()  # edges and KV segments, made by prepare()
        self.exchange = HandleExchange({})  # CUDA IPC edges' handles, paired at each start
        self._lock_fd: int | None = None
        self._control: PullChannel | None = None
        self.policy = RestartPolicy(sup.max_restarts, sup.restart_window_s)
        self.heartbeats = Heartbeats(sup.heartbeat_timeout_s)
        self.ring: RingState = "up"
        self.restarts = 0
        self.last_failure = ""
        self._respawn_at = 0.0
        self._ring_deadline = 0.0
        self._new_bridge = False
        self._absent: tuple[str, ...] = ()  # the missing hosts the bridge was last told of

    @property
    def hosts(self) -> HostLink | None:
        """The followers' link (a plan across hosts, once prepare() bound it)."""
        return self.spawner.hosts

    @property
    def children(self) -> list[Child]:
        return self.stages + ([self.bridge] if self.bridge is not None else [])

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

    def spawn(self) -> None:
        """Start every child that is not running: all of them at first, after a failure
        the stages (and the bridge when it was the one that died)."""
        if not self.stages:  # the ring's children: its stages, then their expert shards
            self.exchange.clear()
            wanted: list[tuple[Role, int]] = [("stage", k) for k in range(len(self.layout.places))]
            self.stages = self.spawner.start(
                self.layout, wanted + [("shard", k) for k in range(len(self.layout.shards))]
            )
        if self.bridge is None:
            [self.bridge] = self.spawner.start(self.layout, [("bridge", 0)])
            self._new_bridge = True
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
        while not (all(c.ready for c in self.children) and self.fronts.ready):
            if time.monotonic() > deadline:
                late = [c.name for c in [*self.children, *self.fronts.running.values()] if not c.ready]
                raise LaunchError(f"not ready after {self.timeouts.ready_s:.0f} s: {', '.join(late)}")
            failure = self._lost() or self.fronts.exited()
            if failure is not None:
                raise LaunchError(f"{failure} during start-up")
            self._pulse("during start-up")
            self._note(self._control_messages(100))
        self._open(deadline)
        if self.state == "starting":  # a SIGTERM that came during _open stands: serve() drains at once
            self.state = "running"
        self.notifier.ready(f"serving {len(self.layout.places)} stages from {self.runtime_dir}")

    def _pulse(self, doing: str) -> None:
        """While starting: stop as on SIGTERM once the parent is gone; ping the watchdog."""
        self._watch_parent()
        if self.state == "draining":
            raise StartInterrupted(f"stopped {doing}")
        self.notifier.watchdog()

    def _open(self, deadline: float, restarts: int = 0) -> None:
        """Every child is ready: the bridge takes requests (a new bridge binds the client
        endpoint first, and binding an ipc socket makes its file)."""
        pids = tuple(c.process.pid for c in self.stages if c.process.pid is not None)
        if self.bridge is None:
            raise LaunchError("no bridge to open")
        self.bridge.command.send(Command("serve", message=self.last_failure, restarts=restarts, pids=pids))
        while self._new_bridge and not self.ends.client_path.exists():
            dead = self._dead()
            if dead is not None:
                raise LaunchError(f"{dead.name} exited with code {dead.process.returncode} during start-up")
            if time.monotonic() > deadline + 10:
                raise LaunchError("the bridge did not bind the client endpoint")
            time.sleep(0.01)
        self._new_bridge = False
        self.ring = "up"

    def _note(self, messages: list) -> None:
        """Readiness and heartbeats, matched to the current children by name and pid."""
        now = time.monotonic()
        for message in messages:
            if not isinstance(message, (Ready, Heartbeat, EdgeHandles)):
                continue
            role = getattr(message, "role", "stage")  # EdgeHandles come from stages
            if role == "front" and not isinstance(message, EdgeHandles):
                self.fronts.note(message, now)
                continue
            name = "bridge" if role == "bridge" else f"{role}-{message.index}"
            child = next((c for c in self.children if c.name == name and c.process.pid == message.pid), None)
            if child is None and isinstance(message, Ready):  # a follower's worker may say so before its follower
                child = next((c for c in self.children if c.name == name and c.process.pid is None), None)
                if child is not None and isinstance(child.process, RemoteProcess):
                    child.process.pid = message.pid
            if child is None:
                continue  # from a child of a ring that has already been replaced
            if isinstance(message, EdgeHandles):
                self._pass_handles(message)
            elif isinstance(message, Ready):
                child.ready = True
                self.heartbeats.watch(name, now)
            else:
                self.heartbeats.beat(name, now)

    def _pass_handles(self, half: EdgeHandles) -> None:
        """A stage's CUDA IPC handles: once both sides of its edge sent theirs, each gets the other's."""
        try:
            for target, other in self.exchange.offer(half):
                self.stages[target].command.send(Command("attach", handles=(other,)))
        except HandshakeError as exc:
            self.log.error("bad CUDA IPC handles", error=str(exc))  # the stage waits in vain: its start-up times out

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
            failure = self._failure()
            if failure is not None:
                self._failed(failure)
                continue
            self.notifier.watchdog()
            self.fronts.check(time.monotonic())
            if self.ring != "up" and self.state == "running":
                self._restart_step()
            if self.state == "draining":
                if self.bridge is None or not self.bridge.ready or self.ring != "up":
                    self.log.info("stopping while the ring restarts: nothing to drain")
                    self._stop_all("shutting_down")
                    continue
                if drain_deadline is None:
                    self.log.info("draining", timeout_s=self.timeouts.drain_s)
                    self.notifier.stopping(f"draining: up to {self.timeouts.drain_s:g} s for running requests")
                    self.bridge.command.send(Command("drain"))
                    drain_deadline = time.monotonic() + self.timeouts.drain_s
                if any(isinstance(m, Drained) for m in messages):
                    self.log.info("drained")
                    self._stop_all("shutting_down")
                elif time.monotonic() > drain_deadline:
                    self.log.warning("drain timeout: ending the requests still running")
                    self._stop_all("shutting_down")

    def _lost(self) -> str | None:
        """A host gone silent, or a child that exited: what to report."""
        missing = self.hosts.missing(time.monotonic()) if self.hosts is not None else None
        if missing is not None:  # before its workers' silence: the host is what failed
            return missing
        dead = self._dead()
        if dead is None:
            return None
        how = ending(dead.process.returncode or 0)  # set: the child is dead
        why = getattr(dead.process, "reason", "")  # a follower's worker: what its follower or the link said
        return f"{dead.name} (pid {dead.process.pid}) {how}" + (f": {why}" if why else "")

    def _failure(self) -> str | None:
        """What has gone wrong with a child, if anything: it exited, or it went silent."""
        lost = self._lost()
        if lost is not None:
            return lost
        silent = self.heartbeats.silent(time.monotonic())
        if silent is not None:
            name, quiet_s = silent
            child = next(c for c in self.children if c.name == name)
            if isinstance(child.process, RemoteProcess) and self.hosts is not None:
                lost = self.hosts.silent_host(child.process.host, time.monotonic())
                if lost is not None:  # its follower has gone quiet too: the host is what failed
                    return lost
            self._kill([child])
            return f"{name} (pid {child.process.pid}) hung: no heartbeat for {quiet_s:.1f} s; killed it"
        return None

    def _failed(self, reason: str) -> None:
        """A child failed: tell every request, kill the stages, restart after the back-off
        (or give up: draining, or too many failures within the window)."""
        # Read once: SIGTERM may arrive while this runs (killing children takes time),
        # and a failure noticed before the stop request is handled as one, consistently.
        running = self.state == "running"
        self.log.error("child failed", reason=reason)
        self.last_failure = reason
        bridge = self.bridge
        self._kill(self.stages)
        self.stages = []
        if bridge is None or bridge.process.poll() is not None:
            self._kill([bridge] if bridge is not None else [])
            self.bridge = None
            for path in self.ends.bridge_files():
                path.unlink(missing_ok=True)
        elif running:
            bridge.command.send(Command("ring_down", "stage_failed", reason))
        delay = self.policy.failed(time.monotonic()) if running else None
        if delay is None:
            if running:
                self.log.error(
                    "giving up",
                    restarts=self.restarts,
                    max_restarts=self.plan.supervise.max_restarts,
                    window_s=self.plan.supervise.restart_window_s,
                )
            self.notifier.stopping(f"stopping: {reason}")
            self.exit_code = 1
            self._stop_all("stage_failed")
            return
        self.ring = "down"
        self._respawn_at = time.monotonic() + delay
        self.notifier.status(f"restarting in {delay:g} s after: {reason}")
        self.log.info("restarting", delay_s=delay)

    def _restart_step(self) -> None:
        now = time.monotonic()
        if self.ring == "down" and now >= self._respawn_at:
            if self.hosts is not None and self.hosts.absent:
                return  # the ring needs every host: wait for their kvasird join
            self.spawn()
            self.ring = "starting"
            self._ring_deadline = now + self.timeouts.ready_s
        elif self.ring == "starting":
            if all(c.ready for c in self.children):
                try:
                    self._open(self._ring_deadline, self.restarts + 1)
                except LaunchError as exc:
                    self._failed(str(exc))
                    return
                self.restarts += 1
                self.log.info("serving again", restarts=self.restarts)
                self.notifier.status(f"serving {len(self.layout.places)} stages; restarted {self.restarts} times")
            elif now > self._ring_deadline:
                late = ", ".join(c.name for c in self.children if not c.ready)
                self._kill([c for c in self.children if not c.ready])
                self._failed(f"not ready after {self.timeouts.ready_s:.0f} s: {late}")

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
        if absent != self._absent and self.bridge is not None and self.bridge.ready:
            self.bridge.command.send(Command("hosts", hosts=absent))
            self._absent = absent

    def _dead(self) -> Child | None:
        return next((child for child in self.children if child.process.poll() is not None), None)

    def _kill(self, children: list[Child]) -> None:
        for child in children:
            if child.process.poll() is None:
                child.process.kill()
        for child in children:
            child.process.wait()
            child.command.socket.close(linger=0)
            self.heartbeats.forget(child.name)
        self._sweep()

    def _sweep(self) -> None:
        """Remove shared memory whose creator is gone (killed children's, a killed daemon's)."""
        for path, size in sweep_stale_segments():
            self.log.warning("removed stale shared memory", file=str(path), bytes=size)

    def _stop_all(self, code: str) -> None:
        self.state = "stopping"
        bridge = self.bridge
        if bridge is not None and bridge.process.poll() is None:
            bridge.command.send(Command("stop", code))
            join_children(self.log, [bridge], self.timeouts.stop_s)
        self.fronts.stop(self.timeouts.stop_s)  # after the bridge: its last events reach HTTP clients
        # stages before their expert shards: a stage may need its shards to finish a batch
        for group in ([c for c in self.stages if c.name.startswith("stage-")], self.stages):
            for child in group:
                if child.process.poll() is None:
                    child.command.send(Command("stop", code))
            join_children(self.log, group, self.timeouts.stop_s)

    # -- cleanup --------------------------------------------------------------------------
    def cleanup(self) -> None:
        """Stop whatever still runs, remove sockets, shared memory and the lock."""
        self._kill(self.children)  # and sweep their shared memory
        self.fronts.close()
        if self.hosts is not None:
            self.hosts.halt_all("the leader stops")
        self.layout.close()
        self.sockets.end()
        if self._lock_fd is not None:
            for sock in self.ends.socket_files():
                sock.unlink(missing_ok=True)
            (self.runtime_dir / "kvasird.lock").unlink(missing_ok=True)
            os.close(self._lock_fd)
            self._lock_fd = None
        self.state = "stopped"
