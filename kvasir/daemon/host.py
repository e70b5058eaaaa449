"""Checks of a plan against this host before anything starts: the CPUs and CUDA devices it
names exist, and every worker runs on this host (the leader)."""

from __future__ import annotations

import os

from kvasir.config.cluster import worker_host
from kvasir.config.plan import Plan
from kvasir.errors import PlanError


def check_host(plan: Plan) -> None:
    """Refuse (PlanError) a plan this machine cannot run: absent CPUs or CUDA devices."""
    import torch

    usable = os.sched_getaffinity(0)
    for pool, view in plan.pools():
        for index, stage in enumerate(view.stages):
            key = f"{pool}.stages[{index}]" if pool else f"stages[{index}]"
            _check_on_leader(key, plan, stage.host)
            _check_stage_host(key, stage, usable, torch)
            for j, shard in enumerate(stage.experts):  # expert shards: the same keys
                _check_on_leader(f"{key}.experts[{j}]", plan, shard.host, stage.host)
                _check_stage_host(f"{key}.experts[{j}]", shard, usable, torch)


def _check_on_leader(key: str, plan: Plan, *hosts: str | None) -> None:
    """This version runs every worker on the leader: followers (`kvasird join`) are not built yet."""
    host = worker_host(plan.cluster, *hosts)
    if plan.cluster is not None and host != plan.cluster.leader:
        raise PlanError(
            f"{key} runs on host {host}: this version runs every worker on the leader ({plan.cluster.leader}); "
            "workers on other hosts need `kvasird join`, which is not built yet (kvasir plan check shows the layout)"
        )


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
