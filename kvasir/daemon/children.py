"""The launcher's children (stages, expert shards and the bridge): what it knows of each, and where each
stage sits in the plan."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field

from kvasir.config.plan import Plan, Pool
from kvasir.wire.control import EdgeSpec, ShardWiring
from kvasir.wire.transport import PushChannel


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
