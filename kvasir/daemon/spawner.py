"""How the launcher starts its children: each one's settings (its place in the layout,
its sockets' routes when the plan spans hosts), then the process, here for the leader's
own children, on its follower (kvasir/daemon/remote.py) for another host's."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from kvasir.config.cluster import worker_host
from kvasir.config.devices import torch_dtype
from kvasir.config.keys import POOL_SECRET
from kvasir.config.kvpool import folder_budgets
from kvasir.config.plan import Plan
from kvasir.config.sections import Pool
from kvasir.daemon.children import Child, ChildId, spawn_child
from kvasir.daemon.forks import Zygote
from kvasir.daemon.layout import Layout
from kvasir.daemon.remote import Cluster, HostLink
from kvasir.logs import Logger
from kvasir.model.source import ModelSource
from kvasir.ring.shm import pool_folder, segment_prefix
from kvasir.transport.fabric import Sockets
from kvasir.wire.base import Role
from kvasir.wire.control import (
    BridgeSettings,
    Command,
    FrontSettings,
    ModelFacts,
    PoolTiers,
    ShardSettings,
    StageSettings,
    WorkerSettings,
)


@dataclass
class Spawner:
    plan: Plan
    source: ModelSource
    runtime_dir: Path
    sockets: Sockets
    cluster: Cluster | None
    stats_interval_s: float
    log_level: str
    log: Logger
    hosts: HostLink | None = None  # the followers, once the launcher bound their socket
    zygote: Zygote | None = None  # forks the local workers (kvasir/daemon/forks.py)
    prefix: str = field(default_factory=segment_prefix)  # the shared-memory names' start

    def start(self, layout: Layout, wanted: list[ChildId]) -> list[Child]:
        """Spawn the leader's children here, hand the others to their followers."""
        settings = [self.settings(layout, child) for child in wanted]
        leader = self.cluster.keys.host if self.cluster is not None else None
        here = [s for s in settings if s.fabric is None or s.fabric.host == leader]
        children = {child.id: child for child in (spawn_child(s, self.sockets, zygote=self.zygote) for s in here)}
        if self.hosts is not None:
            children.update(self.hosts.start([s for s in settings if s not in here], layout, self.prefix))
        for spawned in children.values():
            self.log.info("spawned", child=spawned.name, pid=spawned.process.pid)
        for want in wanted:
            children[want].id = want  # with its pool and instance
        return [children[want] for want in wanted]

    def settings(self, layout: Layout, child: ChildId) -> WorkerSettings:
        """A ring child's settings: a stage's place in the pool it serves now (``child.pool``:
        a movable instance's may differ from the plan's), a shard's wiring, the bridge's
        model facts."""
        role, index = child.role, child.index
        place, shards = layout.place_of(role, index, self.plan)
        common = self._common(self._host(role, index))
        plan = place.view(child.pool)
        if role == "stage":
            return StageSettings(
                index=index,
                plan=plan,
                edges=place.edges,
                pool=child.pool,
                instance=place.instance,
                first=place.first,
                handoff=layout.wiring,
                shards=shards,
                kv_pool=pool_tiers(self.plan, index, self.prefix),
                **common,
            )
        if role == "shard":
            [wiring] = shards
            return ShardSettings(index=index, plan=plan, wiring=wiring, pool=child.pool, **common)
        return BridgeSettings(plan=self.plan, model=self._model_facts(), **common)

    def regroup(self, layout: Layout, children: list[Child], pool: Pool) -> None:
        """Tell a moving instance's children (it holds no request) to serve ``pool``: each
        stage gets its ring's plan there (its widths), each shard the pool its stats name."""
        for child in children:
            place, _ = layout.place_of(child.id.role, child.id.index, self.plan)
            plan = place.view(pool) if child.id.role == "stage" else None
            child.command.send(Command("regroup", pool=pool, plan=plan))
            child.id = replace(child.id, pool=pool)

    def front(self, index: int, listen_fd: int) -> FrontSettings:
        """An HTTP front's settings: it runs beside the launcher and reaches the bridge as a client."""
        host = self.cluster.keys.host if self.cluster is not None else None
        return FrontSettings(
            index=index, plan=self.plan, model=self._model_facts(), listen_fd=listen_fd, **self._common(host)
        )

    def _common(self, host: str | None) -> dict:
        """What every child's settings hold besides its role's own."""
        return {
            "runtime_dir": str(self.runtime_dir),
            "launcher_pid": os.getpid(),
            "stats_interval_s": self.stats_interval_s,
            "log_level": self.log_level,
            "fabric": self.cluster.fabric(host) if self.cluster is not None and host is not None else None,
        }

    def _host(self, role: Role, index: int) -> str | None:
        """Where a child runs: the bridge on the leader, a stage or shard where the plan says."""
        if self.cluster is None:
            return None
        if role == "bridge":
            return self.cluster.keys.host
        placement = self.cluster.placement
        return (placement.stages if role == "stage" else placement.shards)[index]

    def _model_facts(self) -> ModelFacts:
        source, folder = self.source, self.source.weights_dir
        per_token = (
            2 * source.num_layers * source.kv_heads * source.head_dim * torch_dtype(self.plan.model.dtype).itemsize
        )
        return ModelFacts(source.vocab_size, str(folder) if folder is not None else None, per_token)


def pool_tiers(plan: Plan, index: int, prefix: str) -> PoolTiers | None:
    """Stage ``index``'s (global) part of the KV pool's tiers on its host: each tier's
    folder of its layers and that folder's bytes; its host's memory tier is the folder
    named from ``prefix`` (the shared-memory names of the daemon, or of the follower, on
    that host); a plan across hosts keys its slices with the fleet's secret in cluster.keys."""
    pool = plan.kv_pool
    if pool is None:
        return None
    stages = [(worker_host(plan.cluster, stage.host) or "", stage.layers) for stage in plan.all_stages]
    host, disk = folder_budgets(pool.host_bytes, stages)[index], folder_budgets(pool.disk_bytes, stages)[index]
    keys = plan.cluster.keys if plan.cluster is not None else None
    return PoolTiers(
        host_dir=str(pool_folder(prefix)) if host else "",
        host_bytes=host,
        disk_dir=pool.disk_dir or "" if disk else "",
        disk_bytes=disk,
        secret_file=str(Path(keys) / POOL_SECRET) if keys else "",
    )
