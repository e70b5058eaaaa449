"""The launcher's children (stages, expert shards and the bridge): what it knows of each, and where each
stage sits in the plan."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field

import msgspec
import zmq

from kvasir.config.plan import Plan, Pool
from kvasir.wire.control import Command, EdgeSpec, ShardWiring, WorkerSettings
from kvasir.wire.transport import Endpoints, PushChannel, make_socket


@dataclass
class Child:
    name: str  # "stage-0", ..., "shard-0", ..., "bridge"
    process: subprocess.Popen
    command: PushChannel
    ready: bool = False


@dataclass
class StagePlace:
    """Where a stage process sits: its pool (its ring's plan), global index and ring edges."""

    pool: Pool
    plan: Plan
    first: int  # global index of the pool's first stage
    edges: list[EdgeSpec]
    shards: list[ShardWiring] = field(default_factory=list)  # its expert shards


def spawn_child(settings: WorkerSettings, ctx: zmq.Context, ends: Endpoints) -> Child:
    """Start a child as a fresh interpreter (never a fork after torch is imported), hand it
    its settings as msgpack on stdin, and connect to its command socket."""
    name = "bridge" if settings.role == "bridge" else f"{settings.role}-{settings.index}"
    process = subprocess.Popen([sys.executable, "-m", "kvasir.daemon.worker"], stdin=subprocess.PIPE)
    if process.stdin is not None:  # always, with stdin=PIPE
        process.stdin.write(msgspec.msgpack.encode(settings))
        process.stdin.close()
    command = PushChannel[Command](make_socket(ctx, zmq.PUSH, connect=ends.command(name)))
    return Child(name, process, command)
