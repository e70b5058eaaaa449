"""Pools that follow the load: instances that change pool while serving (docs/planner.md).

A disaggregated plan with a ``[planner]`` section lays its instances out so that each
one may serve either pool: an instance without widths or a cache of its own is
**movable**. Moving it (``kvasir instances move``) stops routing new work to it, waits
for its requests to finish, and has its stage processes serve the other pool with that
pool's batch widths (kvasir/stage/roles.py: they keep their weights and KV cache); the
other instances serve on.

What stays put across a move is what the other instances have mapped or connected to:
a movable instance's KV cache is laid out once, in shared memory (a prefill stage's
cache is where decode stages copy handed-off K/V from), so it is as large as the larger
pool's (``kv.num_blocks``) in either pool, and the pools' caches must agree on
everything else (block size, prefix caching). Its edges are sized for the wider of the
pools' widths.

- ``enabled``: the automatic planner (kvasir/bridge/planner.py): every ``interval_s`` it
  reads the time to first token and the inter-token latency at the ``percentile``
  against ``ttft_s`` and ``itl_s`` and moves one instance from the pool with slack to
  the pool that misses, or while both meet them to the busier pool (``patience``,
  ``headroom`` and ``cooldown_s`` keep it from flapping).
- ``min_prefill`` / ``min_decode``: a move, by hand or by the planner, never leaves a
  pool with fewer serving instances than this.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import msgspec

from kvasir.config.sections import BatchSpec, InstanceSpec, KvSpec, Pool, PoolSpec
from kvasir.errors import PlanError

MOVABLE_POOLS: tuple[Pool, ...] = ("prefill", "decode")


class PlannerSpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    enabled: bool = False  # the automatic planner; without it moves are by hand
    min_prefill: int = 1  # serving prefill instances a move never goes below
    min_decode: int = 1  # serving decode instances a move never goes below
    ttft_s: float = 2.0  # the target: time to first token, at the percentile (the prefill pool's)
    itl_s: float = 0.2  # the target: gap between a request's tokens, at the percentile (the decode pool's)
    percentile: float = 90.0  # of the interval's samples
    interval_s: float = 10.0  # one decision per interval, on its samples
    patience: int = 2  # intervals in a row a pool misses (while the other has slack) before a move
    headroom: float = 0.8  # the giving pool, one instance smaller, must stay under this busy share
    cooldown_s: float = 30.0  # after a move ends, none for this long (its samples settle)


class RolePlan(Protocol):
    """What this module reads of a Plan (kvasir/config/plan.py imports this module)."""

    @property
    def batch(self) -> BatchSpec: ...

    @property
    def kv(self) -> KvSpec: ...

    @property
    def prefill(self) -> PoolSpec | None: ...

    @property
    def decode(self) -> PoolSpec | None: ...

    @property
    def planner(self) -> PlannerSpec | None: ...


def pool_batch(plan: RolePlan, pool: Pool) -> BatchSpec:
    """A pool's widths: its own, else the plan's."""
    spec: PoolSpec | None = getattr(plan, pool) if pool else None
    return (spec.batch if spec is not None else None) or plan.batch


def pool_kv(plan: RolePlan, pool: Pool) -> KvSpec:
    spec: PoolSpec | None = getattr(plan, pool) if pool else None
    return (spec.kv if spec is not None else None) or plan.kv


def fixed_reason(plan: RolePlan, spec: InstanceSpec, pool: Pool) -> str:
    """Why an instance stays in its pool ("" when it may move)."""
    if plan.planner is None or pool not in MOVABLE_POOLS:
        return "the plan has no [planner] section: its pools are fixed"
    own = [part for part in ("batch", "kv") if getattr(spec, part) is not None]
    if own:
        return f"it has its own [{pool}.instances.{own[0]}]: its widths and cache are its own pool's"
    return ""


def moving_cache(plan: RolePlan) -> KvSpec:
    """A movable instance's cache in every pool: the larger pool's block count."""
    caches = [pool_kv(plan, pool) for pool in MOVABLE_POOLS]
    return max(caches, key=lambda kv: kv.num_blocks)


def widest(plan: RolePlan) -> BatchSpec:
    """Widths every pool's fit in: what a movable instance's edges are sized for."""
    batches = [pool_batch(plan, pool) for pool in MOVABLE_POOLS]
    return BatchSpec(
        max_rows=max(b.max_rows for b in batches),
        max_tokens=max(b.max_tokens for b in batches),
        inflight=max(b.inflight for b in batches),
    )


def check_planner(plan: RolePlan, counts: Mapping[Pool, int]) -> None:
    """The section against the plan: its pools, their caches, the minimums against
    ``counts`` (each pool's instances)."""
    spec = plan.planner
    if spec is None:
        return
    if plan.prefill is None:
        raise PlanError(
            "planner: instances move between a disaggregated plan's pools: give [[prefill.stages]] and "
            "[[decode.stages]] (or their instances) instead of [[stages]]"
        )
    _check_targets(spec)
    for pool in MOVABLE_POOLS:
        least = getattr(spec, f"min_{pool}")
        if least < 1:
            raise PlanError(f"planner.min_{pool} must be >= 1 (a pool with no instance serves nobody), got {least}")
        if counts.get(pool, 0) < least:
            raise PlanError(f"planner.min_{pool} = {least}, but the plan starts {counts.get(pool, 0)} {pool} instances")
    first, second = (pool_kv(plan, pool) for pool in MOVABLE_POOLS)
    for key in ("block_size", "prefix_cache", "prefix_share"):
        if getattr(first, key) != getattr(second, key):
            raise PlanError(
                f"prefill.kv.{key} = {getattr(first, key)!r} and decode.kv.{key} = {getattr(second, key)!r} differ: "
                "with [planner] a moving instance keeps one cache in both pools, so they must agree"
            )


def _check_targets(spec: PlannerSpec) -> None:
    for key in ("ttft_s", "itl_s", "interval_s"):
        value = getattr(spec, key)
        if not 0 < value < 86_400:
            raise PlanError(f"planner.{key} must be a positive number of seconds under a day, got {value}")
    if not 0 <= spec.cooldown_s < 86_400:
        raise PlanError(f"planner.cooldown_s must be >= 0 seconds and under a day, got {spec.cooldown_s}")
    if not 0 < spec.percentile <= 100:
        raise PlanError(f"planner.percentile must be in (0, 100], got {spec.percentile}")
    if not 1 <= spec.patience <= 1000:
        raise PlanError(f"planner.patience must be 1 to 1000 intervals, got {spec.patience}")
    if not 0 < spec.headroom <= 1:
        raise PlanError(f"planner.headroom must be in (0, 1] (a share of the time busy), got {spec.headroom}")
