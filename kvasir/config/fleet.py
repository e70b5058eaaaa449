"""Instances: the rings a plan runs, and their checks.

A pool (the colocated plan's one, or a disaggregated plan's prefill and decode pools)
is served by one or more instances, each a ring of its own: its stages split every
layer of the model, and it has its own widths and cache. ``[[stages]]`` (or
``[[POOL.stages]]``) is one instance, named after its pool; ``[[instances]]`` (or
``[[POOL.instances]]``) lists several, each with a ``name`` and its own stages.

Stages are numbered in one global sequence, pool by pool and instance by instance;
a ring knows the global index of its head (``first``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import msgspec

from kvasir.config.cluster import ClusterSpec, worker_host
from kvasir.config.roles import PlannerSpec, fixed_reason, moving_cache
from kvasir.config.sections import POOLS, BatchSpec, InstanceSpec, KvSpec, Pool, PoolSpec, StageSpec
from kvasir.errors import PlanError


class FleetPlan(Protocol):
    """What this module reads of a Plan (kvasir/config/plan.py imports this module)."""

    @property
    def stages(self) -> tuple[StageSpec, ...]: ...

    @property
    def instances(self) -> tuple[InstanceSpec, ...]: ...

    @property
    def prefill(self) -> PoolSpec | None: ...

    @property
    def decode(self) -> PoolSpec | None: ...

    @property
    def batch(self) -> BatchSpec: ...

    @property
    def kv(self) -> KvSpec: ...

    @property
    def cluster(self) -> ClusterSpec | None: ...

    @property
    def hosts(self) -> Mapping[str, Any]: ...

    @property
    def planner(self) -> PlannerSpec | None: ...


P = TypeVar("P", bound=FleetPlan)

MAX_INSTANCES = 64  # instances in one plan, all pools together
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,31}$")
SINGLE_NAMES: dict[Pool, str] = {"": "ring", "prefill": "prefill", "decode": "decode"}  # a [[stages]] instance


@dataclass(frozen=True)
class Ring(Generic[P]):
    """One instance: its pool (where the plan starts it), its name, where its stages are
    in the plan file (``key``, for messages), the global index of its head, its ring as a
    plan of its own, and why it stays in its pool ("": it may move, kvasir/config/roles.py)."""

    pool: Pool
    name: str
    key: str
    first: int
    plan: P
    fixed: str = ""

    @property
    def movable(self) -> bool:
        return not self.fixed

    @property
    def stages(self) -> int:
        return len(self.plan.stages)

    @property
    def last(self) -> int:
        """The global index of its tail."""
        return self.first + self.stages - 1


def pool_instances(plan: FleetPlan) -> list[tuple[Pool, str, InstanceSpec]]:
    """Every instance with its pool and the key of its stages in the plan file."""
    if plan.prefill is None and plan.decode is None:
        return _listed("", "", plan.stages, plan.instances)
    found = []
    for name in POOLS:
        pool: PoolSpec | None = getattr(plan, name)
        if pool is not None:
            found += _listed(name, f"{name}.", pool.stages, pool.instances)
    return found


def _listed(pool: Pool, prefix: str, stages, instances) -> list[tuple[Pool, str, InstanceSpec]]:
    if instances:
        return [(pool, f"{prefix}instances[{i}].stages", spec) for i, spec in enumerate(instances)]
    return [(pool, f"{prefix}stages", InstanceSpec(name=SINGLE_NAMES[pool], stages=stages))]


def rings(plan: P) -> list[Ring[P]]:
    """Each instance as a ring plan of its own, in global stage order."""
    found: list[Ring[P]] = []
    first = 0
    for pool, key, spec in pool_instances(plan):
        shared: PoolSpec | None = getattr(plan, pool) if pool else None
        fixed = fixed_reason(plan, spec, pool)
        cache = moving_cache(plan) if not fixed else None  # the same in every pool it may serve
        view: P = msgspec.structs.replace(
            plan,  # type: ignore[type-var]  # a Plan, a Struct (the Protocol cannot say so)
            stages=spec.stages,
            instances=(),
            batch=spec.batch or (shared.batch if shared else None) or plan.batch,
            kv=cache or spec.kv or (shared.kv if shared else None) or plan.kv,
            prefill=None,
            decode=None,
        )
        found.append(Ring(pool, spec.name, key, first, view, fixed))
        first += len(spec.stages)
    return found


def check_pools(plan: P, check_ring: Callable[[str, P, InstanceSpec], None]) -> None:
    """The pools and their instances: which tables go together, unique names, and each
    ring by ``check_ring(key, ring plan, instance)`` (its widths, cache and stages)."""
    if plan.prefill is None and plan.decode is None:
        _check_listing("", plan.stages, plan.instances)
    else:
        if plan.stages or plan.instances:
            table = "[[stages]]" if plan.stages else "[[instances]]"
            raise PlanError(
                f"{table[2:-2]}: a disaggregated plan has its stages in its pools "
                f"([[prefill.stages]] and [[decode.stages]], or their instances) instead of {table}"
            )
        for name in POOLS:
            pool = getattr(plan, name)
            if pool is None:
                other = next(n for n in POOLS if n != name)
                raise PlanError(f"{name}: a plan with [{other}] needs a [{name}] pool too (with its [[{name}.stages]])")
            _check_listing(f"{name}.", pool.stages, pool.instances)
    listed = pool_instances(plan)
    if len(listed) > MAX_INSTANCES:
        raise PlanError(f"instances: the plan has {len(listed)} instances; at most {MAX_INSTANCES}")
    seen: dict[str, str] = {}
    for (_, key, spec), ring in zip(listed, rings(plan), strict=True):
        where = key.removesuffix(".stages")
        if not _NAME_RE.match(spec.name):
            raise PlanError(
                f"{where}.name = {spec.name!r}: an instance name is 1-32 letters, digits, '-' or '_', "
                "starting with a letter or digit"
            )
        if spec.name in seen:
            raise PlanError(f"{where}.name = {spec.name!r} is {seen[spec.name]}'s name too: names are unique")
        seen[spec.name] = where
        check_ring(key, ring.plan, spec)


def _check_listing(prefix: str, stages, instances) -> None:
    if stages and instances:
        raise PlanError(
            f"{prefix}instances: give [[{prefix}stages]] (one instance) or [[{prefix}instances]] (several), not both"
        )


@dataclass(frozen=True)
class KvLink:
    """One prefill stage's share of a hand-off to one decode stage: the layers they share
    and how the K/V crosses (``shm`` on one host, ``tcp`` between hosts)."""

    source: int  # the prefill stage's global index
    target: int  # the decode stage's
    layers: tuple[int, int]
    via: str  # "shm" | "tcp HOST -> HOST"


def handoff_routes(plan: P) -> list[tuple[Ring[P], Ring[P], list[KvLink]]]:
    """Every (prefill instance, decode instance) pair of a disaggregated plan with the
    stage-to-stage links a request's KV takes between them."""
    pools = rings(plan)
    routes = []
    for prefill in (ring for ring in pools if ring.pool == "prefill"):
        for decode in (ring for ring in pools if ring.pool == "decode"):
            links = []
            for i, mine in enumerate(prefill.plan.stages):
                for j, theirs in enumerate(decode.plan.stages):
                    lo, hi = max(mine.layers[0], theirs.layers[0]), min(mine.layers[1], theirs.layers[1])
                    if lo >= hi:
                        continue
                    a, b = worker_host(plan.cluster, mine.host), worker_host(plan.cluster, theirs.host)
                    via = "shm" if a == b else f"tcp {a} -> {b}"
                    links.append(KvLink(prefill.first + i, decode.first + j, (lo, hi), via))
            routes.append((prefill, decode, links))
    return routes
