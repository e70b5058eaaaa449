"""The ring's children and the restart-window state machine, apart from the launcher's
process plumbing (which it reaches through ``Plumbing``), so it is tested on its own with
stand-in processes and a clock.

The ring is "up" while it serves. A failure (a child exited or went silent, a host went
missing) takes it "down": every request is told, the stages are killed, and a restart
waits out the policy's back-off (kvasir/daemon/supervision.py); then "starting" (new
children loading) until every child is ready and the bridge serves again, back to "up".
Too many failures within the window, or a failure while the daemon drains, and the
supervisor gives up: ``failed`` returns False and the launcher stops everything.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal, Protocol

from kvasir.daemon.children import BRIDGE, Child, ChildId, ending
from kvasir.daemon.remote import RemoteProcess
from kvasir.daemon.supervision import Heartbeats, RestartPolicy
from kvasir.errors import KvasirError
from kvasir.logs import Logger
from kvasir.wire.control import EdgeHandles, Heartbeat, Ready

RingState = Literal["up", "down", "starting"]


class OpenError(KvasirError):
    """The bridge could not start serving the ring (it died, or never bound its endpoint)."""


class HostWatch(Protocol):
    """What the supervisor asks of the followers' link (kvasir/daemon/remote.py)."""

    @property
    def absent(self) -> list[str]: ...

    def missing(self, now: float) -> str | None: ...

    def silent_host(self, host: str, now: float) -> str | None: ...


class Plumbing(Protocol):
    """The launcher's side: processes, sockets and service status."""

    @property
    def hosts(self) -> HostWatch | None: ...

    def spawn_children(self, wanted: list[ChildId]) -> list[Child]: ...

    def kill(self, children: list[Child]) -> None: ...

    def open(self, restarts: int, new_bridge: bool, deadline: float) -> None:
        """Tell the bridge to serve the ring; raises OpenError when it cannot."""

    def ring_down(self, reason: str) -> None:
        """Tell the (live) bridge the ring failed: it ends every request with stage_failed."""

    def bridge_gone(self) -> None:
        """The bridge died: remove its socket files."""

    def status(self, text: str) -> None: ...


@dataclass
class RingSupervisor:
    ring_ids: list[ChildId]  # every stage in ring order, then every expert shard
    policy: RestartPolicy
    heartbeats: Heartbeats
    plumbing: Plumbing
    ready_s: float  # how long new children may take to be ready
    log: Logger
    stages: list[Child] = field(default_factory=list)  # the ring's children (shards after the stages)
    bridge: Child | None = None
    state: RingState = "up"
    restarts: int = 0
    last_failure: str = ""
    new_bridge: bool = False  # spawned and not yet serving: opening it waits for its endpoint
    respawn_at: float = 0.0
    deadline: float = 0.0  # "starting": when the new children must be ready

    @property
    def children(self) -> list[Child]:
        return self.stages + ([self.bridge] if self.bridge is not None else [])

    @property
    def ready(self) -> bool:
        return all(child.ready for child in self.children)

    def spawn_missing(self) -> None:
        """Start the ring's children if there are none, and a bridge if there is none."""
        if not self.stages:
            self.stages = self.plumbing.spawn_children(self.ring_ids)
        if self.bridge is None:
            [self.bridge] = self.plumbing.spawn_children([BRIDGE])
            self.new_bridge = True

    def open(self, deadline: float, restarts: int = 0) -> None:
        """Every child is ready: the bridge serves, told how many restarts this ring
        follows (raises OpenError when it cannot)."""
        self.plumbing.open(restarts, self.new_bridge, deadline)
        self.new_bridge = False
        self.state = "up"

    # -- what the children say --------------------------------------------------------
    def note(self, messages: Iterable[Ready | Heartbeat | EdgeHandles], now: float) -> list[EdgeHandles]:
        """Readiness and heartbeats, matched to the current children by id and pid; the
        CUDA IPC halves from current stages, to be passed on (a replaced child's are dropped)."""
        halves = []
        for message in messages:
            role = "stage" if isinstance(message, EdgeHandles) else message.role
            child = self._current(ChildId(role, message.index if role != "bridge" else 0), message.pid)
            if child is None:
                continue  # from a child of a ring that has already been replaced
            if isinstance(message, EdgeHandles):
                halves.append(message)
            elif isinstance(message, Ready):
                child.ready = True
                self.heartbeats.watch(child.name, now)
            else:
                self.heartbeats.beat(child.name, now)
        return halves

    def _current(self, wanted: ChildId, pid: int) -> Child | None:
        child = next((c for c in self.children if c.id == wanted and c.process.pid == pid), None)
        if child is None:  # a follower's worker may say it is ready before its follower says it started
            child = next((c for c in self.children if c.id == wanted and c.process.pid is None), None)
            if child is not None and isinstance(child.process, RemoteProcess):
                child.process.pid = pid
            else:
                child = None
        return child

    # -- failures -----------------------------------------------------------------------
    def lost(self, now: float) -> str | None:
        """A host gone silent, or a child that exited: what to report."""
        hosts = self.plumbing.hosts
        missing = hosts.missing(now) if hosts is not None else None
        if missing is not None:  # before its workers' silence: the host is what failed
            return missing
        dead = next((child for child in self.children if child.process.poll() is not None), None)
        if dead is None:
            return None
        how = ending(dead.process.returncode or 0)  # set: the child is dead
        why = getattr(dead.process, "reason", "")  # a follower's worker: what its follower or the link said
        return f"{dead.name} (pid {dead.process.pid}) {how}" + (f": {why}" if why else "")

    def failure(self, now: float) -> str | None:
        """What has gone wrong with a child, if anything: it exited, or it went silent (then killed)."""
        lost = self.lost(now)
        if lost is not None:
            return lost
        silent = self.heartbeats.silent(now)
        if silent is None:
            return None
        name, quiet_s = silent
        child = next(c for c in self.children if c.name == name)
        if isinstance(child.process, RemoteProcess) and self.plumbing.hosts is not None:
            gone = self.plumbing.hosts.silent_host(child.process.host, now)
            if gone is not None:  # its follower has gone quiet too: the host is what failed
                return gone
        self.kill([child])
        return f"{name} (pid {child.process.pid}) hung: no heartbeat for {quiet_s:.1f} s; killed it"

    def failed(self, reason: str, now: float, serving: bool) -> bool:
        """A child failed: tell every request, kill the stages, and schedule the restart
        after the back-off. False: give up (the daemon is not serving, or too many
        failures within the window); the launcher then stops everything."""
        self.log.error("child failed", reason=reason)
        self.last_failure = reason
        bridge = self.bridge
        self.kill(self.stages)
        self.stages = []
        if bridge is None or bridge.process.poll() is not None:
            self.kill([bridge] if bridge is not None else [])
            self.bridge = None
            self.plumbing.bridge_gone()
        elif serving:
            self.plumbing.ring_down(reason)
        delay = self.policy.failed(now) if serving else None
        if delay is None:
            if serving:
                self.log.error(
                    "giving up",
                    restarts=self.restarts,
                    max_restarts=self.policy.max_restarts,
                    window_s=self.policy.window_s,
                )
            return False
        self.state = "down"
        self.respawn_at = now + delay
        self.plumbing.status(f"restarting in {delay:g} s after: {reason}")
        self.log.info("restarting", delay_s=delay)
        return True

    def step(self, now: float) -> bool:
        """Move a restart on: spawn once the back-off is over (and every host is there),
        serve once every new child is ready. False: it failed and gave up."""
        if self.state == "down" and now >= self.respawn_at:
            hosts = self.plumbing.hosts
            if hosts is not None and hosts.absent:
                return True  # the ring needs every host: wait for their kvasird join
            self.spawn_missing()
            self.state = "starting"
            self.deadline = now + self.ready_s
        elif self.state == "starting" and self.ready:
            try:
                self.open(self.deadline, self.restarts + 1)
            except OpenError as exc:
                return self.failed(str(exc), now, serving=True)
            self.restarts += 1
            self.log.info("serving again", restarts=self.restarts)
            stages = sum(1 for child in self.ring_ids if child.role == "stage")
            self.plumbing.status(f"serving {stages} stages; restarted {self.restarts} times")
        elif self.state == "starting" and now > self.deadline:
            late = [c for c in self.children if not c.ready]
            self.kill(late)
            return self.failed(f"not ready after {self.ready_s:.0f} s: {', '.join(c.name for c in late)}", now, True)
        return True

    def kill(self, children: list[Child]) -> None:
        self.plumbing.kill(children)
        for child in children:
            self.heartbeats.forget(child.name)
