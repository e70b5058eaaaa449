"""The plan's ``[kv_pool]`` section: prefix blocks kept past their eviction from an
instance's cache, in tiers below it (docs/architecture.md, The KV pool).

- ``host_bytes``: a memory tier on each host (files in shared memory, /dev/shm), which
  every stage of the daemon on that host uses; lost when the daemon stops.
- ``disk_dir`` and ``disk_bytes``: a disk tier, the same folder on each host; it
  survives restarts.

Each size is a host's whole tier: every stage on the host gets a share in proportion to
its layers (its slices are that share of a block's bytes), and the stages of the same
layers on a host, which share a folder, keep that folder within their shares together.
No ``[kv_pool]``: no pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import PurePosixPath

import msgspec

from kvasir.errors import PlanError

MAX_LOAD_TIMEOUT_S = 600.0


class KvPoolSpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    host_bytes: int = 0  # each host's memory tier, all its stages together (0: none)
    disk_dir: str | None = None  # the disk tier's folder on every host (an absolute path)
    disk_bytes: int = 0  # each host's disk tier, all its stages together (0: none)
    load_timeout_s: float = 10.0  # a head waits this long for its stages to load a prefix, then computes it


def check_kv_pool(pool: KvPoolSpec, prefix_cache: bool, disaggregated: bool) -> None:
    """The section's values against each other and the plan (``prefix_cache``: every
    instance keeps its prefix cache on, which names the blocks the pool stores)."""
    for key in ("host_bytes", "disk_bytes"):
        if getattr(pool, key) < 0:
            raise PlanError(f"kv_pool.{key} must be >= 0 bytes, got {getattr(pool, key)}")
    if (pool.disk_dir is None) != (pool.disk_bytes == 0):
        raise PlanError(
            "kv_pool.disk_dir and kv_pool.disk_bytes go together: set both for a disk tier, neither for none"
        )
    if pool.disk_dir is not None and not PurePosixPath(pool.disk_dir).is_absolute():
        raise PlanError(f"kv_pool.disk_dir = {pool.disk_dir!r} must be an absolute path (it is used on every host)")
    if pool.host_bytes == 0 and pool.disk_bytes == 0:
        raise PlanError("[kv_pool] has no tier: set kv_pool.host_bytes, or kv_pool.disk_dir and kv_pool.disk_bytes")
    if not 0 < pool.load_timeout_s <= MAX_LOAD_TIMEOUT_S:
        raise PlanError(
            f"kv_pool.load_timeout_s must be in (0, {MAX_LOAD_TIMEOUT_S:g}] seconds, got {pool.load_timeout_s}"
        )
    if not prefix_cache:
        raise PlanError("[kv_pool] keeps prefix-cache blocks: it needs kv.prefix_cache = true in every instance")
    if disaggregated:
        raise PlanError("[kv_pool] is not served with [prefill] and [decode] pools yet: use a colocated plan")


def tier_shares(total: int, stages: Sequence[tuple[str, tuple[int, int]]]) -> list[int]:
    """Each stage's bytes of a per-host tier of ``total`` bytes: ``stages`` are (host,
    layers) in global order; a host's stages share its ``total`` in proportion to their layers."""
    layers_on: dict[str, int] = {}
    for host, (first, end) in stages:
        layers_on[host] = layers_on.get(host, 0) + end - first
    return [total * (end - first) // layers_on[host] for host, (first, end) in stages]


def folder_budgets(total: int, stages: Sequence[tuple[str, tuple[int, int]]]) -> list[int]:
    """Each stage's folder's bytes: the shares (``tier_shares``) of every stage of the same
    host and layers, which share one folder of the tier."""
    shares = tier_shares(total, stages)
    by_folder: dict[tuple[str, tuple[int, int]], int] = {}
    for stage, share in zip(stages, shares):
        by_folder[stage] = by_folder.get(stage, 0) + share
    return [by_folder[stage] for stage in stages]
