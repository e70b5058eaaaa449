"""The launcher's side of the followers (``kvasird join``) of a plan across hosts.

``HostLink`` binds the leader's ``hosts`` ROUTER and keeps what the launcher knows of
each follower: which host it is (from the CURVE key it authenticated with, never from
what it says), its pid, when it was last heard from. It hands a follower its workers
and stops them, and turns the follower's reports into ``RemoteProcess``es, which the
launcher supervises as it does its own children's Popen objects: an exit reported by
the follower, or the follower gone silent (its host died, or the link is down:
``cluster.host_silence_s``; a connection that dropped and did not come back: 1.2 s),
is a child that died.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import zmq

from kvasir.config.plan import Plan
from kvasir.daemon.children import Child, ChildId
from kvasir.daemon.layout import Layout
from kvasir.logs import Logger
from kvasir.model.fingerprint import model_identity
from kvasir.transport.channels import PushChannel, waiting
from kvasir.transport.curve import HostKeys
from kvasir.transport.fabric import Sockets
from kvasir.transport.resets import Resets
from kvasir.transport.routes import Placement, Routes, plan_digest
from kvasir.wire.control import Command, FabricSettings, HostSegments, WorkerSettings
from kvasir.wire.decoding import Decoder, Malformed
from kvasir.wire.hosts import (
    ALIVE_EVERY_S,
    PING_EVERY_S,
    Alive,
    Exited,
    FollowerMessage,
    Halt,
    Ping,
    Refused,
    Run,
    Spawned,
    Stop,
)


@dataclass
class RemoteProcess:
    """A worker on a follower host, with what the launcher uses of a Popen."""

    link: HostLink
    host: str
    name: str
    generation: int
    pid: int | None = None  # once the follower reported the start
    returncode: int | None = None
    reason: str = ""  # why it stopped, when the follower or the link says

    def poll(self) -> int | None:
        return self.returncode

    def kill(self) -> None:
        """Stop it (its follower kills it; the host's other workers run on)."""
        if self.returncode is None:
            self.link.stop(self.host, self.name, f"the leader stops {self.name}")
            self.returncode = -int(signal.SIGKILL)
        if self.link.processes.get(self.name) is self:  # what its follower says of it now is of no use
            del self.link.processes[self.name]

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.name, timeout or 0.0)
            self.link.receive(20)
        return self.returncode


def _first(seen: set, key) -> bool:
    """Whether ``key`` is new to ``seen`` (then added; a thousand keys at most are kept)."""
    if key in seen:
        return False
    if len(seen) >= 1024:
        seen.clear()
    seen.add(key)
    return True


@dataclass
class FollowerState:
    pid: int
    heard: float


@dataclass
class HostLink:
    sockets: Sockets
    leader: str
    needed: set[str]  # the hosts, besides the leader's, that run workers and are neither standby nor drained
    owners: dict[bytes, str]  # each host's public key (z85) -> its name
    digest: str  # the plan's (kvasir/transport/routes.py plan_digest): a follower's must be the same
    model: str  # the served model's identity (kvasir/model/fingerprint.py): a follower's must be the same
    timeout_s: float
    log: Logger
    followers: dict[str, FollowerState] = field(default_factory=dict)
    processes: dict[str, RemoteProcess] = field(default_factory=dict)  # the current worker of each name
    generation: int = 0
    drained: dict[str, int] = field(default_factory=dict)  # host -> the pid of the kvasird join it was drained under

    def __post_init__(self) -> None:
        self.required = frozenset(self.needed)  # the plan's needed hosts (a drained one is needed again once back)
        self.router = self.sockets.bind(zmq.ROUTER, self.sockets.ends.hosts)
        self.router.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a follower that reconnects takes its name back
        self.resets = Resets(self.router, self.sockets.keep)
        self._decoder: Decoder[FollowerMessage] = Decoder(FollowerMessage)
        self._next_ping = 0.0
        self._refused: set[tuple[str, int]] = set()
        self._strangers: set[tuple[str, str | None]] = set()  # (name given, host of the key) dropped

    # -- what arrives ----------------------------------------------------------------------
    def receive(self, timeout_ms: int = 0) -> None:
        if not self.router.poll(timeout_ms):
            return
        for parts in waiting(self.router, multipart=True, copy=False):
            self._take(parts)

    def _take(self, parts: list[zmq.Frame]) -> None:
        key = str(parts[-1].get("User-Id")).encode()  # the CURVE key the sender authenticated with
        host = self.owners.get(key)
        named = bytes(parts[0].bytes).decode(errors="replace")
        if len(parts) != 2 or host != named:
            if _first(self._strangers, (named, host)):  # said once: a stray follower says it twice a second
                self.log.warning("dropped a follower message", named=named, key_of=host, frames=len(parts))
            return
        try:
            message = self._decoder.decode(parts[1].buffer)
        except Malformed as exc:
            self.log.warning("dropped a malformed follower message", host=host, error=str(exc))
            return
        if isinstance(message, Alive):
            self._alive(host, message)
        elif isinstance(message, (Spawned, Exited)):
            self._report(host, message)

    def _alive(self, host: str, message: Alive) -> None:
        why = None
        if message.digest != self.digest:
            why = f"host {host}'s plan differs from the leader's (stages, hosts or ports)"
        elif message.model != self.model:
            why = (
                f"host {host} serves another model than the leader: its weights or model.dtype differ "
                f"({message.model[:40]} there, {self.model} here)"
            )
        if why is not None:
            if _first(self._refused, (host, message.pid)):  # said once; the answer goes with every Alive
                self.log.error("refused a follower", host=host, pid=message.pid, why=why)
            self._send(host, Refused(why))
            return
        now = time.monotonic()
        state = self.followers.get(host)
        if state is not None and state.pid == message.pid:
            state.heard = now
            return
        if state is not None:  # its kvasird join restarted: whatever it ran is gone
            self._lose(host, f"host {host}'s kvasird join restarted (pid {state.pid} -> {message.pid})")
        self.followers[host] = FollowerState(message.pid, now)
        if self.drained.get(host, message.pid) != message.pid:  # a new kvasird join: the host is back
            del self.drained[host]
            self.needed |= {host} & self.required
        self.log.info("host joined", host=host, pid=message.pid, drained=host in self.drained)
        # whatever it still runs is no current worker of ours (a Run replaces only what it names)
        self._send(host, Halt("the leader takes this host afresh"))
        self._send(host, Ping())

    def _report(self, host: str, message: Spawned | Exited) -> None:
        process = self.processes.get(message.name)
        if process is None or process.host != host or process.generation != message.generation:
            return  # about workers of a ring already replaced
        if isinstance(message, Spawned):
            process.pid = message.pid
        elif process.returncode is None:
            process.pid = process.pid or message.pid
            process.returncode = message.code
            process.reason = message.reason

    def _lose(self, host: str, reason: str) -> None:
        for process in self.processes.values():
            if process.host == host and process.returncode is None:
                process.returncode, process.reason = -int(signal.SIGKILL), reason

    # -- the launcher's loop ---------------------------------------------------------------
    def tick(self, now: float) -> None:
        """Ping the followers (their sign that the leader lives)."""
        if now >= self._next_ping:
            self._next_ping = now + PING_EVERY_S
            for host in self.followers:
                self._send(host, Ping())

    def missing(self, now: float) -> str | None:
        """A follower silent past ``cluster.host_silence_s``, or silent since a connection
        to it dropped (its processes died: its kernel reset their connections) and not back
        within the grace: forgotten, its workers lost; what to report."""
        for host, state in list(self.followers.items()):
            quiet = now - state.heard
            reset = self.resets.unanswered(state.heard, now)
            if quiet > self.timeout_s or reset:
                del self.followers[host]
                why = f"host {host} is missing: " + (
                    f"its connection dropped and it has not spoken for {quiet:.1f} s"
                    if reset
                    else f"no word from its kvasird join for {quiet:.1f} s"
                )
                live = any(p.host == host and p.returncode is None for p in self.processes.values())
                self._lose(host, why)
                if live:
                    return why
                self.log.warning("host missing", host=host, quiet_s=round(quiet, 1))
        return None

    def silent_host(self, host: str, now: float) -> str | None:
        """One of ``host``'s workers went silent: if its follower has too (missed two
        Alives), the host is lost (forgotten, its workers with it); what to report."""
        state = self.followers.get(host)
        if state is not None and now - state.heard <= 4 * ALIVE_EVERY_S:
            return None
        self.followers.pop(host, None)
        why = f"host {host} is missing: " + (
            f"no word from its kvasird join for {now - state.heard:.1f} s" if state else "its kvasird join is gone"
        )
        self._lose(host, why)
        return why

    @property
    def absent(self) -> list[str]:
        """The needed hosts whose follower has not joined (the ring cannot start yet)."""
        return sorted(self.needed - set(self.followers))

    def _present(self, host: str) -> bool:
        """Its follower has joined, and not the kvasird join it was drained under."""
        return host in self.followers and self.drained.get(host) != self.followers[host].pid

    def available(self, hosts: frozenset[str]) -> bool:
        """Every one of ``hosts`` is present."""
        return all(self._present(h) for h in hosts)

    def parks(self, hosts: frozenset[str]) -> bool:
        """One of ``hosts`` is standby or drained (not needed) and not present."""
        return any(h not in self.needed and not self._present(h) for h in hosts)

    def drain(self, host: str) -> None:
        """``kvasir hosts drain``: the host is not needed until a new kvasird join there."""
        state = self.followers.get(host)
        self.drained[host] = state.pid if state is not None else 0
        self.needed.discard(host)
        self.log.info("host drained", host=host, pid=self.drained[host])

    # -- what goes out ---------------------------------------------------------------------
    def start(self, wanted: Iterable[WorkerSettings], layout: Layout, prefix: str) -> dict[ChildId, Child]:
        """Hand each follower these workers (the host's others run on); their Child entries."""
        by_host: dict[str, list[WorkerSettings]] = {}
        for settings in wanted:
            if settings.fabric is not None:
                by_host.setdefault(settings.fabric.host, []).append(settings)
        if not by_host:
            return {}  # the bridge alone: the ring's workers stay as they are
        self.generation += 1
        children = {}
        for host, workers in by_host.items():
            segments = layout.hosted.get(host, HostSegments())
            self._send(host, Run(self.generation, prefix, segments, workers))
            for settings in workers:
                child = ChildId.of(settings)
                process = RemoteProcess(self, host, child.name, self.generation)
                self.processes[child.name] = process
                command = PushChannel[Command](self.sockets.connect(zmq.PUSH, self.sockets.ends.command(child.name)))
                children[child] = Child(child, process, command)
        return children

    def stop(self, host: str, name: str, reason: str) -> None:
        self._send(host, Stop([name], reason))

    def halt(self, host: str, reason: str) -> None:
        self._send(host, Halt(reason))

    def halt_all(self, reason: str) -> None:
        for host in self.followers:
            self.halt(host, reason)

    def _send(self, host: str, message) -> None:
        try:
            self.router.send_multipart([host.encode(), msgspec.msgpack.encode(message)], zmq.NOBLOCK)
        except zmq.Again:
            self.log.warning("the link to a follower is full: message dropped", host=host)


@dataclass(frozen=True)
class Cluster:
    """The leader's view of a plan across hosts: where each worker runs, every socket's
    route, the hosts' keys (the leader's own secret from ``secret``)."""

    placement: Placement
    routes: Routes
    keys: HostKeys
    folder: str  # the plan's cluster.keys, absolute
    secret: str

    @classmethod
    def of(cls, plan: Plan, secret: str | None = None) -> Cluster | None:
        """None for a plan on one machine; FabricError when the leader's keys do not load."""
        placement = Placement.of(plan)
        if plan.cluster is None or plan.cluster.keys is None or not placement.spans_hosts:
            return None
        folder, leader = plan.cluster.keys, plan.cluster.leader
        secret = secret or str(Path(folder) / f"{leader}.key_secret")
        keys = HostKeys.load(folder, leader, sorted(plan.hosts), secret)
        return cls(placement, Routes.of(placement), keys, folder, secret)

    def fabric(self, host: str | None) -> FabricSettings:
        """A worker's settings for its sockets (a follower puts its own secret in)."""
        return FabricSettings(
            host=host or self.keys.host, keys=self.folder, secret=self.secret, sockets=self.routes.table()
        )

    def link(self, sockets: Sockets, plan: Plan, log: Logger, weights: Path | None) -> HostLink:
        """Bind the followers' socket; ``weights``: the served model's folder."""
        placement = self.placement
        needed = {host for host in (*placement.stages, *placement.shards) if host is not None} - {placement.leader}
        needed -= {name for name, host in plan.hosts.items() if host.standby}
        return HostLink(
            sockets,
            self.keys.host,
            needed,
            {key: name for name, key in self.keys.hosts.items()},
            plan_digest(plan, self.routes),
            model_identity(weights, plan.model.dtype),
            plan.cluster.host_silence_s if plan.cluster is not None else plan.supervise.heartbeat_timeout_s,
            log,
        )
