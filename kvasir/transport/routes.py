"""Where each of the daemon's internal sockets is, in a plan whose workers span hosts.

On one machine every socket is an ``ipc://`` file in the runtime directory
(``Endpoints``). Once a plan places workers on several hosts (``[cluster]``,
kvasir/config/cluster.py), every internal socket is TCP on its owner's host, at the
host's ``address``, and CURVE-authenticated with the hosts' keys: one rule, the same for
a socket whose peers happen to share its host (their traffic is descriptors, credits and
reports; boundary tensors between two workers of one host still go through shared memory).

Each host's sockets take consecutive ports from its ``port`` in a fixed order that
every host derives from the plan alone, so the leader and the followers agree on every
address without asking each other.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvasir.config.cluster import HostSpec, worker_host
from kvasir.config.plan import Plan
from kvasir.errors import KvasirError

MAX_PORT = 65535
COMMAND_PREFIX = "command-"  # the launcher's command sockets: only the leader sends to them (kvasir/transport/curve.py)


class RouteError(KvasirError):
    """A socket name that no worker of the plan owns, or a host's ports run past 65535."""


@dataclass(frozen=True)
class Placement:
    """Which host runs what: the leader (launcher, bridge), each stage by global index,
    each expert shard by number. Hosts are None for a plan on one machine."""

    leader: str | None
    stages: tuple[str | None, ...]
    shards: tuple[str | None, ...]
    hosts: Mapping[str, HostSpec]
    kv_pool: bool = False  # the plan has a KV pool: each stage serves its slices to other hosts

    @classmethod
    def of(cls, plan: Plan) -> Placement:
        cluster = plan.cluster
        stages = plan.all_stages
        shards = tuple(worker_host(cluster, shard.host, stage.host) for stage in stages for shard in stage.experts)
        return cls(
            leader=cluster.leader if cluster is not None else None,
            stages=tuple(worker_host(cluster, stage.host) for stage in stages),
            shards=shards,
            hosts=dict(plan.hosts),
            kv_pool=plan.kv_pool is not None,
        )

    @property
    def spans_hosts(self) -> bool:
        return len({self.leader, *self.stages, *self.shards}) > 1


def socket_names(placement: Placement) -> list[tuple[str, str | None]]:
    """Every internal socket (its name in the runtime dir, less ``.sock``) with its owner's
    host, in the fixed order ports are handed out."""
    leader = placement.leader
    names: list[tuple[str, str | None]] = [
        ("control", leader),
        ("hosts", leader),  # the followers' link (kvasird join)
        ("bridge-in", leader),
        (f"{COMMAND_PREFIX}bridge", leader),
    ]
    for k, host in enumerate(placement.stages):
        names += [(f"{part}-{k}", host) for part in ("stage", "credits", "kv", "experts", f"{COMMAND_PREFIX}stage")]
    for n, host in enumerate(placement.shards):
        names += [(f"shard-{n}", host), (f"{COMMAND_PREFIX}shard-{n}", host)]
    if placement.kv_pool:  # last: a plan without a pool keeps every port it had
        names += [(f"kvpool-{k}", host) for k, host in enumerate(placement.stages)]
    return names


class Routes:
    """The TCP endpoint of each internal socket of a plan that spans hosts, with the host
    that binds it (``Routes.of``; workers get the table in their settings)."""

    def __init__(self, endpoints: Mapping[str, tuple[str, str]]) -> None:
        self._endpoints = dict(endpoints)  # name -> (endpoint, owner host)

    @classmethod
    def of(cls, placement: Placement) -> Routes:
        if not placement.spans_hosts:
            raise RouteError("the plan runs on one machine: its sockets are ipc files, not routes")
        endpoints: dict[str, tuple[str, str]] = {}
        used: dict[str, int] = {}
        for name, host in socket_names(placement):
            if host is None:  # a plan with [cluster] places every worker (worker_host)
                raise RouteError(f"socket {name} has no host")
            spec = placement.hosts[host]
            port = spec.port + used.get(host, 0)
            if port > MAX_PORT:
                raise RouteError(
                    f"hosts.{host}.port = {spec.port}: its sockets need ports up to {port}, past {MAX_PORT}"
                )
            used[host] = used.get(host, 0) + 1
            endpoints[name] = (f"tcp://{_bracketed(spec.address)}:{port}", host)
        return cls(endpoints)

    def table(self) -> dict[str, tuple[str, str]]:
        """Every socket's (endpoint, owner host), by name: what a worker's settings carry."""
        return dict(self._endpoints)

    def endpoint(self, name: str) -> str:
        try:
            return self._endpoints[name][0]
        except KeyError:
            raise RouteError(f"no worker of the plan owns a socket called {name!r}") from None

    def names(self) -> list[str]:
        return list(self._endpoints)

    def owner(self, name: str) -> str:
        """The host whose process binds ``name``."""
        return self._endpoints[name][1]

    def ports(self, host: str) -> list[int]:
        """The ports ``host``'s processes bind (to open in its firewall)."""
        return [int(url.rpartition(":")[2]) for url, owner in self._endpoints.values() if owner == host]


def _bracketed(address: str) -> str:
    return f"[{address}]" if ":" in address else address


def plan_digest(plan: Plan, routes: Routes) -> str:
    """What the leader and a follower must agree on, hashed: every socket's endpoint and
    owner, each stage's layers and each shard's experts (their plan files may differ in
    paths, never in these)."""
    import hashlib

    import msgspec

    shape = [[stage.layers, [shard.experts for shard in stage.experts]] for stage in plan.all_stages]
    encoded = msgspec.json.encode([sorted(routes.table().items()), shape])
    return hashlib.sha256(encoded).hexdigest()[:16]
