"""Several hosts in a plan: ``[cluster]`` names the leader (the host that runs ``kvasird
start``: launcher, bridge, clients) and the folder of the hosts' CURVE public keys;
``[hosts.NAME]`` says where each host is reached. ``host`` on a stage or an expert shard
places that worker (a stage's default: the leader; a shard's: its stage's host).

``check_cluster`` checks what can be checked without the model or the key files (names,
addresses, ports, every ``host`` naming a host); ``kvasir/daemon/resolve.py`` loads the
keys.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

import msgspec

from kvasir.errors import PlanError

DEFAULT_PORT = 7300  # a host's first port: control, then its data edges
MIN_HOST_SILENCE_S = 1.0
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$")
_HOSTNAME_RE = re.compile(
    r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$"
)


class ClusterSpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    leader: str  # the host that runs `kvasird start`
    keys: str | None = None  # folder with each host's CURVE public key NAME.key; relative: from the plan's folder
    host_silence_s: float = 5.0  # a host (leader or follower) silent this long is lost (its link is down)


class HostSpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    address: str  # where the other hosts reach it (an IP address or a host name)
    port: int = DEFAULT_PORT  # the first port of its range
    standby: bool = False  # its instances start once its `kvasird join` is there, the others need not wait


class HostedPlan(Protocol):
    """What the checks read of a Plan (kvasir/config/plan.py imports this module)."""

    @property
    def cluster(self) -> ClusterSpec | None: ...

    @property
    def hosts(self) -> Mapping[str, HostSpec]: ...

    def rings(self) -> Sequence[Any]: ...  # kvasir/config/fleet.py's Ring


def host_names(hosts: Mapping[str, HostSpec]) -> str:
    return ", ".join(sorted(hosts)) or "none"


def worker_host(cluster: ClusterSpec | None, *hosts: str | None) -> str | None:
    """Where a worker runs: the first host given (a shard's own, then its stage's), else
    the leader; None for a plan without [cluster] (everything on this machine)."""
    for host in hosts:
        if host is not None:
            return host
    return cluster.leader if cluster is not None else None


def check_cluster(plan: HostedPlan) -> None:
    """Hosts, addresses and keys' presence; every ``host`` a host of the plan; no edge
    between two hosts asking for a same-host slot kind."""
    cluster, hosts = plan.cluster, plan.hosts
    if cluster is None and hosts:
        raise PlanError("hosts: a plan with [hosts.NAME] tables needs [cluster] (its leader and keys)")
    if cluster is not None:
        _check_hosts(cluster, hosts)
    for key, host in _placed(plan):
        if host not in hosts:
            where = f"the plan's hosts are {host_names(hosts)}" if hosts else "the plan has no [hosts.NAME] tables"
            raise PlanError(f"{key}.host = {host!r} is not a host of the plan ({where})")
    _check_standby(plan)
    for ring in plan.rings():
        stages, key = ring.plan.stages, ring.key
        for i, (stage, nxt) in enumerate(zip(stages, stages[1:])):
            a, b = worker_host(cluster, stage.host), worker_host(cluster, nxt.host)
            if a != b and stage.edge not in (None, "auto"):
                raise PlanError(
                    f"{key}[{i}].edge = {stage.edge!r}: the edge goes from host {a} to host {b}, and only tcp "
                    "crosses hosts (leave the key out)"
                )


def ring_hosts(cluster: ClusterSpec | None, ring: Any) -> set[str]:
    """The hosts an instance's workers (stages and expert shards) run on (empty: one machine)."""
    found = set()
    for stage in ring.plan.stages:
        found.add(worker_host(cluster, stage.host))
        found.update(worker_host(cluster, shard.host, stage.host) for shard in stage.experts)
    return {host for host in found if host is not None}


def standby_instances(plan: HostedPlan) -> list[str]:
    """The instances with a worker on a standby host: they serve once it joins."""
    standby = {name for name, host in plan.hosts.items() if host.standby}
    return [ring.name for ring in plan.rings() if ring_hosts(plan.cluster, ring) & standby]


def _check_standby(plan: HostedPlan) -> None:
    """The leader is never standby, and every pool has an instance that starts without one."""
    cluster = plan.cluster
    if cluster is not None and cluster.leader in plan.hosts and plan.hosts[cluster.leader].standby:
        raise PlanError(f"hosts.{cluster.leader}.standby: the leader cannot be a standby host")
    parked, every = set(standby_instances(plan)), plan.rings()
    for pool in sorted({ring.pool for ring in every}):
        names = [ring.name for ring in every if ring.pool == pool]
        if parked.issuperset(names):
            raise PlanError(
                f"every instance of the {pool or 'fleet'}{' pool' if pool else ''} has a worker on a standby host "
                f"({', '.join(names)}): one at least must start with the leader"
            )


def _placed(plan: HostedPlan) -> Iterator[tuple[str, str]]:
    """(key, host) of every stage and shard that names its host."""
    for ring in plan.rings():
        key = ring.key
        for i, stage in enumerate(ring.plan.stages):
            if stage.host is not None:
                yield f"{key}[{i}]", stage.host
            for j, shard in enumerate(stage.experts):
                if shard.host is not None:
                    yield f"{key}[{i}].experts[{j}]", shard.host


def _check_hosts(cluster: ClusterSpec, hosts: Mapping[str, HostSpec]) -> None:
    if not hosts:
        raise PlanError("cluster: the plan names no hosts: add a [hosts.NAME] table (address) for each machine")
    if not cluster.keys or not cluster.keys.strip():
        raise PlanError(
            "cluster.keys is missing: a plan with hosts needs the folder of each host's CURVE public key "
            "(make them with `kvasir keys generate DIR --host NAME ...`)"
        )
    if not MIN_HOST_SILENCE_S <= cluster.host_silence_s < float("inf"):
        raise PlanError(
            f"cluster.host_silence_s = {cluster.host_silence_s:g}: at least {MIN_HOST_SILENCE_S:g} s "
            "(hosts say they are alive twice a second)"
        )
    if cluster.leader not in hosts:
        raise PlanError(f"cluster.leader = {cluster.leader!r} is not one of the hosts ({host_names(hosts)})")
    seen: dict[str, str] = {}
    for name, host in hosts.items():
        if not _NAME_RE.match(name):
            raise PlanError(
                f"hosts.{name}: a host name is 1-63 letters, digits, '-' or '_' (it names the host's key file)"
            )
        if not _is_address(host.address):
            raise PlanError(f"hosts.{name}.address = {host.address!r} is neither an IP address nor a host name")
        if not 0 < host.port < 65536:
            raise PlanError(f"hosts.{name}.port = {host.port} is not a TCP port (1-65535)")
        other = seen.get(host.address)
        if other is not None:
            raise PlanError(
                f"hosts.{name}.address = {host.address!r} is hosts.{other}'s too: two hosts with one address"
            )
        seen[host.address] = name


def _is_address(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return _HOSTNAME_RE.match(text) is not None
    return True
