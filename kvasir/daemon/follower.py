"""``kvasird join``: a follower host of a plan across hosts.

A follower connects to the leader's ``hosts`` socket (CURVE, its host's key) and says it
is alive about twice a second. The leader hands it the workers of its host (``Run``:
settings and the shared memory to make for them); the follower makes the segments under
its own names, starts the workers with its own paths (runtime dir, model, keys) and
reports each start and each exit; a ``Run`` or a ``Stop`` touches only the workers it
names (another instance of the host serves on). The workers talk to the leader and to
each other directly over the plan's TCP routes. When the leader says ``Halt``, or has been silent
for the plan's ``cluster.host_silence_s`` (the link is down) or for 1.2 s after its
connection dropped (dead: kvasir/transport/resets.py), the follower kills its workers and
waits for a leader to take it again; it runs until SIGTERM or SIGINT.
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import msgspec
import zmq

from kvasir.config.plan import Plan
from kvasir.daemon.children import ChildId, start_local
from kvasir.daemon.forks import ForkedProcess, Zygote
from kvasir.daemon.layout import Layout, make_segments
from kvasir.daemon.notify import ServiceNotifier
from kvasir.daemon.spawner import pool_tiers
from kvasir.errors import KvasirError
from kvasir.logs import Logger
from kvasir.ring.shm import check_segment_names, make_pool_folder, remove_pool_folder, segment_prefix
from kvasir.transport.channels import Endpoints, waiting
from kvasir.transport.curve import Fabric, HostKeys
from kvasir.transport.fabric import Sockets
from kvasir.transport.resets import Resets
from kvasir.transport.routes import Placement, Routes, plan_digest
from kvasir.transport.rundir import lock_runtime_dir
from kvasir.wire.control import HostSegments, ShardSettings, ShardWiring, StageSettings, WorkerSettings
from kvasir.wire.decoding import Decoder, Malformed
from kvasir.wire.hosts import ALIVE_EVERY_S, Alive, Exited, Halt, LeaderMessage, Ping, Refused, Run, Spawned, Stop

FollowerState = Literal["waiting", "running", "stopping"]


@dataclass(frozen=True)
class Local:
    """What a follower puts in its workers' settings in place of the leader's paths."""

    host: str
    runtime_dir: Path
    secret: str  # this host's secret key file
    source: str  # the model, resolved on this host
    model: str  # its identity (kvasir/model/fingerprint.py): the leader refuses a host whose differs
    prefix: str = field(default_factory=segment_prefix)  # this follower's shared-memory names


def segment_names(run: Run) -> list[str]:
    """Every shared-memory name a Run carries: the segments to make and those its workers'
    settings name."""
    names = run.segments.names()
    for settings in run.workers:
        match settings:
            case StageSettings(edges=edges, shards=shards, handoff=handoff):
                names += [edge.name for edge in edges] + [wiring.slot.name for wiring in shards]
                names += [kv.name for kv in handoff.segments.values()] if handoff is not None else []
            case ShardSettings(wiring=wiring):
                names.append(wiring.slot.name)
    return names


def renamed(segments: HostSegments, leader_prefix: str, prefix: str) -> dict[str, str]:
    """Each segment's name under this follower's prefix (a sweep on this host then knows its creator)."""
    return {name: prefix + name[len(leader_prefix) :] for name in segments.names() if name.startswith(leader_prefix)}


def localize(
    settings: WorkerSettings, here: Local, names: dict[str, str], whole: Plan
) -> StageSettings | ShardSettings:
    """A worker's settings from the leader, with this host's paths, pid, segment names and
    KV pool folders (from ``whole``, this host's copy of the plan: a follower runs stages and expert
    shards; anything else is refused)."""
    replace = msgspec.structs.replace
    fabric = settings.fabric
    if not isinstance(settings, StageSettings | ShardSettings) or fabric is None or fabric.host != here.host:
        raise KvasirError(f"the leader sent {ChildId.of(settings).name}, which is not a worker of host {here.host}")

    def slot(wiring: ShardWiring) -> ShardWiring:
        return replace(wiring, slot=replace(wiring.slot, name=names.get(wiring.slot.name, wiring.slot.name)))

    plan = replace(settings.plan, model=replace(settings.plan.model, source=here.source))
    common = dict(plan=plan, runtime_dir=str(here.runtime_dir), launcher_pid=os.getpid())
    common["fabric"] = replace(fabric, secret=here.secret)
    if isinstance(settings, ShardSettings):
        return replace(settings, wiring=slot(settings.wiring), **common)
    handoff = settings.handoff
    if handoff is not None:
        segments = {k: replace(kv, name=names.get(kv.name, kv.name)) for k, kv in handoff.segments.items()}
        handoff = replace(handoff, segments=segments)
    edges = [replace(edge, name=names.get(edge.name, edge.name)) for edge in settings.edges]
    pool = pool_tiers(whole, settings.index, here.prefix)
    shards = [slot(w) for w in settings.shards]
    return replace(settings, edges=edges, shards=shards, handoff=handoff, kv_pool=pool, **common)


@dataclass
class Follower:
    plan: Plan  # resolved on this host (its cluster.keys absolute)
    here: Local
    log: Logger
    notifier: ServiceNotifier = field(default_factory=lambda: ServiceNotifier(None))
    state: FollowerState = "waiting"
    zygote: Zygote | None = None  # forks this host's stages and shards (kvasir/daemon/zygote.py)

    def __post_init__(self) -> None:
        if self.plan.cluster is None or self.plan.cluster.keys is None:
            raise KvasirError("kvasird join needs a plan with [cluster] and its host keys")
        routes = Routes.of(Placement.of(self.plan))
        keys = HostKeys.load(self.plan.cluster.keys, self.here.host, sorted(self.plan.hosts), self.here.secret)
        self.digest = plan_digest(self.plan, routes)
        self.timeout_s = self.plan.cluster.host_silence_s
        self.sockets = Sockets(zmq.Context(), Endpoints(self.here.runtime_dir, routes), Fabric.of(routes, keys))
        self.workers: dict[str, subprocess.Popen | ForkedProcess] = {}
        self.generations: dict[str, int] = {}  # each worker's Run
        self.layout = Layout()  # the shared memory made here, kept across runs
        self._made: set[str] = set()  # its names
        self._pool_made = False  # the KV pool's memory tier folder
        self.heard = 0.0  # when the leader last said anything (0: not since we started or lost it)
        self._lock_fd: int | None = None
        self._link: zmq.Socket | None = None
        self._refused = ""  # the leader's last refusal
        self._resets: Resets | None = None

    # -- the loop --------------------------------------------------------------------------
    def prepare(self) -> None:
        self._lock_fd = lock_runtime_dir(self.here.runtime_dir)
        link = self.sockets.unbound(zmq.DEALER)
        link.routing_id = self.here.host.encode()
        link.setsockopt(zmq.IMMEDIATE, 1)  # nothing queued for a leader that is not there
        link.setsockopt(zmq.SNDHWM, 1000)
        self.sockets.attach(link, self.sockets.ends.hosts)
        self._link = link
        self._resets = Resets(link, self.sockets.keep)

    def request_stop(self, signum: int, _frame=None) -> None:
        self.state = "stopping"

    def run(self) -> None:
        self.notifier.ready(f"host {self.here.host}: waiting for the leader")
        self.log.info("following", host=self.here.host, leader=self.sockets.ends.hosts)
        next_alive = 0.0
        while self.state != "stopping":
            now = time.monotonic()
            if now >= next_alive:
                self._send(Alive(self.here.host, os.getpid(), self.digest, self.here.model))
                next_alive = now + ALIVE_EVERY_S
            for message in self._receive(100):
                self._handle(message)
            self._reap()
            self._leader_gone(time.monotonic())
            self.notifier.watchdog()

    def _leader_gone(self, now: float) -> None:
        """Stop the workers when the leader has been silent for ``cluster.host_silence_s``,
        or since its connection dropped (its processes died) past the grace."""
        if not (self.workers and self.heard):
            return
        if now - self.heard > self.timeout_s:
            self._halt(f"the leader has been silent for {self.timeout_s:g} s")
        elif self._resets is not None and self._resets.unanswered(self.heard, now):
            self._halt(f"the leader's connection dropped and it has not spoken for {now - self.heard:.1f} s")
        else:
            return
        self.heard = 0.0

    def _receive(self, timeout_ms: int) -> list:
        link = self._link
        if link is None or not link.poll(timeout_ms):
            return []
        out = []
        decoder: Decoder[LeaderMessage] = Decoder(LeaderMessage)
        for frame in waiting(link):
            try:
                out.append(decoder.decode(frame))
            except Malformed as exc:
                self.log.warning("dropped a malformed message from the leader", error=str(exc))
        return out

    def _handle(self, message) -> None:
        self.heard = time.monotonic()
        if isinstance(message, Run):
            self._run(message)
        elif isinstance(message, Stop):
            self._stop(message.names, message.reason)
        elif isinstance(message, Halt):
            self._halt(message.reason)
        elif isinstance(message, Refused):
            if message.reason != self._refused:  # the leader answers every Alive: say it once
                self._refused = message.reason
                self.log.error("the leader refused this host", reason=message.reason)
                self.notifier.status(f"refused by the leader: {message.reason}")
        elif not isinstance(message, Ping):
            self.log.warning("unexpected message from the leader", kind=type(message).__name__)

    def _send(self, message) -> None:
        if self._link is None:
            return
        try:
            self._link.send(msgspec.msgpack.encode(message), zmq.NOBLOCK)
        except zmq.Again:
            pass  # no leader connected: it learns what it needs from the next Alive

    # -- workers ---------------------------------------------------------------------------
    def _run(self, run: Run) -> None:
        self._stop([ChildId.of(settings).name for settings in run.workers], "the leader starts it again")
        names = renamed(run.segments, run.prefix, self.here.prefix)
        try:
            check_segment_names(run.prefix, segment_names(run))
            self._pool_folder()
            wanted = run.segments.renamed(names)
            self.layout.rings += make_segments(wanted.without(self._made))
            self._made.update(wanted.names())
            workers = [localize(settings, self.here, names, self.plan) for settings in run.workers]
        except KvasirError as exc:
            self.log.error("cannot run the leader's workers", error=str(exc))
            for settings in run.workers:
                self._send(Exited(run.generation, ChildId.of(settings).name, 0, 1, f"host {self.here.host}: {exc}"))
            return
        for settings in workers:
            name = ChildId.of(settings).name
            process = start_local(settings, zygote=self.zygote)
            self.workers[name] = process
            self.generations[name] = run.generation
            self._send(Spawned(run.generation, name, process.pid))
            self.log.info("spawned", child=name, pid=process.pid)
        self.state = "running"
        self.notifier.status(f"host {self.here.host}: running {', '.join(self.workers)}")

    def _reap(self) -> None:
        for name, process in list(self.workers.items()):
            code = process.poll()
            if code is not None:
                del self.workers[name]
                self.log.warning("worker exited", child=name, pid=process.pid, code=code)
                self._send(Exited(self.generations.pop(name, 0), name, process.pid, code, ""))

    def _halt(self, reason: str) -> None:
        self._stop(list(self.workers), reason)

    def _stop(self, names: list[str], reason: str) -> None:
        """Kill the named workers that run (each reported as exited); with none left, wait."""
        stopping = {name: self.workers.pop(name) for name in names if name in self.workers}
        if stopping:
            self.log.info("stopping workers", reason=reason, workers=list(stopping))
        for process in stopping.values():
            if process.poll() is None:
                process.kill()
        for name, process in stopping.items():
            code = process.wait()
            self._send(Exited(self.generations.pop(name, 0), name, process.pid, code, reason))
        if self.state == "running" and not self.workers:
            self.state = "waiting"
            self.notifier.status(f"host {self.here.host}: waiting for the leader ({reason})")

    def _pool_folder(self) -> None:
        """The KV pool's memory tier on this host, made before any other file of this
        follower's prefix (once); KvasirError if the plan's host_bytes do not fit /dev/shm."""
        pool = self.plan.kv_pool
        if pool is None or pool.host_bytes == 0 or self._pool_made:
            return
        if not make_pool_folder(self.here.prefix, pool.host_bytes):
            self.log.error("the KV pool's memory tier folder existed before this host made it: its stages check it")
        self._pool_made = True

    def cleanup(self) -> None:
        self._halt("kvasird join is stopping")
        if self.zygote is not None:
            self.zygote.close()
        self.layout.close()
        remove_pool_folder(self.here.prefix)  # the KV pool's host memory tier
        self.sockets.end()
        if self._lock_fd is not None:
            (self.here.runtime_dir / "kvasird.lock").unlink(missing_ok=True)
            os.close(self._lock_fd)
            self._lock_fd = None
