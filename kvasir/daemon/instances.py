"""What the supervisor (kvasir/daemon/supervisor.py) keeps of each instance, what it asks
of the launcher's plumbing and of the followers' link, and the instances of a plan as it
starts them (those on standby hosts parked)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

from kvasir.config.cluster import ring_hosts, standby_instances
from kvasir.config.plan import Plan
from kvasir.config.sections import Pool
from kvasir.daemon.children import Child, ChildId
from kvasir.daemon.supervision import RestartPolicy
from kvasir.errors import KvasirError

InstanceState = Literal["up", "down", "starting", "moving", "parked", "joining", "failed"]
EVERY = ""  # an instance name that stands for all of them (the bridge's commands)


class OpenError(KvasirError):
    """The bridge could not start serving an instance (it died, or never bound its endpoint)."""


class HostWatch(Protocol):
    """What the supervisor asks of the followers' link (kvasir/daemon/remote.py)."""

    @property
    def absent(self) -> list[str]: ...

    def missing(self, now: float) -> str | None: ...

    def silent_host(self, host: str, now: float) -> str | None: ...

    def available(self, hosts: frozenset[str]) -> bool:
        """Every one of these hosts has joined (and is not drained)."""

    def parks(self, hosts: frozenset[str]) -> bool:
        """One of these hosts is standby or drained and not available: an instance on them waits parked."""


class Plumbing(Protocol):
    """The launcher's side: processes, sockets and service status."""

    @property
    def hosts(self) -> HostWatch | None: ...

    def spawn_children(self, wanted: list[ChildId]) -> list[Child]: ...

    def kill(self, children: list[Child]) -> None: ...

    def regroup(self, children: list[Child], pool: Pool) -> None:
        """Tell an empty instance's children to serve ``pool`` (each stage says Ready again)."""

    def open(self, instance: str, restarts: int, new_bridge: bool, deadline: float) -> None:
        """Tell the bridge to serve an instance (EVERY: all of them) in its pool; raises OpenError when it cannot."""

    def ring_down(self, instance: str, reason: str) -> None:
        """Tell the (live) bridge an instance failed: it ends that instance's requests with stage_failed."""

    def parked(self, instance: str) -> None:
        """Tell the bridge an instance is parked (it routes nothing to it until "serve")."""

    def bridge_gone(self) -> None:
        """The bridge died: remove its socket files."""

    def status(self, text: str) -> None: ...


@dataclass
class Instance:
    """One instance's children and where its restarts stand."""

    name: str
    pool: Pool
    ids: list[ChildId]  # its stages in ring order, then their expert shards
    policy: RestartPolicy
    hosts: frozenset[str] = frozenset()  # the follower hosts its workers run on
    children: list[Child] = field(default_factory=list)
    state: InstanceState = "up"
    restarts: int = 0
    moves: int = 0  # restarts in another pool (kvasir/config/roles.py), not counted as restarts
    last_failure: str = ""
    respawn_at: float = 0.0
    deadline: float = 0.0  # "starting": when the new children must be ready

    @property
    def ready(self) -> bool:
        return bool(self.children) and all(child.ready for child in self.children)


@dataclass(frozen=True)
class Failure:
    reason: str
    instances: tuple[str, ...]  # the instances it takes down


def plan_instances(plan: Plan, ids: dict[str, list[ChildId]]) -> tuple[list[Instance], dict[str, tuple[str, ...]]]:
    """Each instance of ``plan`` with its restart window (``ids``: its children), those
    with a worker on a standby host parked; and the failure domains: a disaggregated
    plan's instances fail together (a request's life spans a prefill and a decode instance)."""
    sup, cluster, rings = plan.supervise, plan.cluster, plan.rings()
    standby = standby_instances(plan)
    instances = [
        Instance(
            ring.name,
            ring.pool,
            ids[ring.name],
            RestartPolicy(sup.max_restarts, sup.restart_window_s),
            frozenset(ring_hosts(cluster, ring) - {cluster.leader if cluster else ""}),
            state="parked" if ring.name in standby else "up",
        )
        for ring in rings
    ]
    every = tuple(ring.name for ring in rings)
    return instances, {name: every for name in every} if plan.disaggregated else {}
