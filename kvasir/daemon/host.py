"""Checks of a plan against this host before anything starts: the CPUs and CUDA devices
named by the workers this host runs exist."""

from __future__ import annotations

import os

from kvasir.config.cluster import worker_host
from kvasir.config.plan import Plan
from kvasir.errors import PlanError
from kvasir.limits import FD_RESERVE, raise_fd_limit


def check_host(plan: Plan, here: str | None = None) -> None:
    """Refuse (PlanError) a plan this machine cannot run: absent CPUs or CUDA devices for
    the workers it runs (``here``: its host in a plan across hosts, default the leader), or
    too few descriptors for its HTTP fronts' connections (the soft limit is raised first:
    the children inherit it)."""
    import torch

    descriptors = raise_fd_limit()
    if plan.http is not None and here is None and plan.http.max_connections + FD_RESERVE > descriptors:
        raise PlanError(
            f"http.max_connections = {plan.http.max_connections} needs {plan.http.max_connections + FD_RESERVE} "
            f"descriptors per front, and this process may open {descriptors}: raise the limit (LimitNOFILE, "
            "ulimit -n) or lower http.max_connections"
        )

    usable = os.sched_getaffinity(0)
    cluster = plan.cluster
    here = here or (cluster.leader if cluster is not None else None)
    for ring in plan.rings():
        for index, stage in enumerate(ring.plan.stages):
            key = f"{ring.key}[{index}]"
            if worker_host(cluster, stage.host) == here:
                _check_stage_host(key, stage, usable, torch)
            for j, shard in enumerate(stage.experts):  # expert shards: the same keys
                if worker_host(cluster, shard.host, stage.host) == here:
                    _check_stage_host(f"{key}.experts[{j}]", shard, usable, torch)


def _check_stage_host(key: str, stage, usable: set[int], torch) -> None:
    if stage.cpus is not None and not set(stage.cpus) <= usable:
        missing = sorted(set(stage.cpus) - usable)
        raise PlanError(f"{key}.cpus: CPUs {missing} are not available here (usable: {sorted(usable)})")
    if stage.device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise PlanError(f"{key}.device = {stage.device!r} but CUDA is not available here")
        ordinal = int(stage.device.partition(":")[2] or 0)
        if ordinal >= torch.cuda.device_count():
            raise PlanError(
                f"{key}.device = {stage.device!r} but this machine has {torch.cuda.device_count()} CUDA devices"
            )
