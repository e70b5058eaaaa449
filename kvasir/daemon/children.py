"""The launcher's children (stages, expert shards and the bridge): what it knows of each, and where each
stage sits in the plan."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Protocol

import msgspec
import zmq

from kvasir.config.plan import Plan
from kvasir.config.sections import Pool
from kvasir.daemon.environment import worker_env
from kvasir.daemon.forks import ForkedProcess, Zygote, become_subreaper, fork_zygote
from kvasir.logs import Logger
from kvasir.transport.channels import PushChannel
from kvasir.transport.fabric import Sockets
from kvasir.wire.base import Role
from kvasir.wire.control import Command, EdgeSpec, ShardSettings, ShardWiring, StageSettings, WorkerSettings


class Process(Protocol):
    """What the launcher uses of a child's process: a Popen here, a RemoteProcess on a follower."""

    @property
    def pid(self) -> int | None: ...

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def kill(self) -> None: ...

    def wait(self, timeout: float | None = None) -> int: ...


@dataclass(frozen=True)
class ChildId:
    """Which child of the launcher: its role, its index among that role's children (a
    stage's index is global across pools and instances), the pool it serves (a
    disaggregated plan's stages and shards) and its instance (both derived from the
    index, so not compared)."""

    role: Role
    index: int = 0
    pool: Pool = field(default="", compare=False)
    instance: str = field(default="", compare=False)

    @property
    def name(self) -> str:
        """Its name in logs, on the followers' link and in its command socket's file."""
        return "bridge" if self.role == "bridge" else f"{self.role}-{self.index}"

    @classmethod
    def of(cls, settings: WorkerSettings) -> ChildId:
        pool = settings.pool if isinstance(settings, StageSettings | ShardSettings) else ""
        return cls(settings.role, settings.index, pool)


BRIDGE = ChildId("bridge")


@dataclass
class Child:
    id: ChildId
    process: Process
    command: PushChannel
    ready: bool = False

    @property
    def name(self) -> str:
        return self.id.name


@dataclass
class StagePlace:
    """Where a stage process sits: its pool (its ring's plan), global index and ring edges."""

    pool: Pool
    plan: Plan
    first: int  # global index of its ring's first stage
    edges: list[EdgeSpec]
    instance: str  # its ring's name
    shards: list[ShardWiring] = field(default_factory=list)  # its expert shards
    views: dict[Pool, Plan] = field(default_factory=dict)  # a movable instance: its ring in each pool

    def view(self, pool: Pool) -> Plan:
        """Its ring's plan in ``pool`` (the plan's own where it cannot move)."""
        return self.views.get(pool, self.plan)


def ending(code: int) -> str:
    """How a child whose return code is ``code`` ended, in words."""
    return f"killed by signal {-code}" if code < 0 else f"exited with code {code}"


def start_worker(settings: WorkerSettings, pass_fds: tuple[int, ...] = ()) -> subprocess.Popen:
    """Start a worker as a fresh interpreter (where no zygote forks it), in ``worker_env``,
    and hand it its settings as msgpack on stdin (and ``pass_fds``, open under the same
    numbers)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "kvasir.daemon.worker"],
        stdin=subprocess.PIPE,
        pass_fds=pass_fds,
        env=worker_env(os.environ),
    )
    if process.stdin is not None:  # always, with stdin=PIPE
        process.stdin.write(msgspec.msgpack.encode(settings))
        process.stdin.close()
    return process


def start_zygote(log: Logger) -> Zygote | None:
    """The launcher made a child subreaper and its zygote forked from it (its imports first,
    kvasir/daemon/forks.py); None where this system cannot reparent orphans to the launcher
    or a thread runs here already (every worker then starts as a fresh interpreter)."""
    if not become_subreaper():
        log.warning("cannot become a child subreaper: workers start as fresh interpreters")
        return None
    return fork_zygote(log)


def on_cpu_only(plan: Plan) -> bool:
    """Every stage and shard of ``plan`` on the CPU: the plans whose workers the zygote forks
    (a GPU worker starts as a fresh interpreter, CUDA never near a fork)."""
    return all(
        stage.device == "cpu" and all(shard.device == "cpu" for shard in stage.experts) for stage in plan.all_stages
    )


def start_local(
    settings: WorkerSettings, pass_fds: tuple[int, ...] = (), zygote: Zygote | None = None
) -> subprocess.Popen | ForkedProcess:
    """A worker on this host holding ``pass_fds``: forked from ``zygote`` where there is
    one, a fresh interpreter where there is none (or it is gone)."""
    forked = zygote.fork(settings, pass_fds) if zygote is not None else None
    return forked if forked is not None else start_worker(settings, pass_fds)


def spawn_child(
    settings: WorkerSettings, sockets: Sockets, pass_fds: tuple[int, ...] = (), zygote: Zygote | None = None
) -> Child:
    """Start a child here, forked from ``zygote`` where there is one, and connect to its
    command socket."""
    child = ChildId.of(settings)
    process = start_local(settings, pass_fds, zygote)
    return Child(child, process, PushChannel[Command](sockets.connect(zmq.PUSH, sockets.ends.command(child.name))))


def join_children(log, children: list[Child], timeout_s: float) -> None:
    """Wait for ``children`` to exit, together up to ``timeout_s``; kill those still running then."""
    deadline = time.monotonic() + timeout_s
    for child in children:
        try:
            child.process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("child did not stop; killing", child=child.name)
            child.process.kill()
            child.process.wait()
