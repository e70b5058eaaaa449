"""Checks of a plan against this host before anything starts: the CPUs and CUDA devices
named by the workers this host runs exist, and what crosses hosts can be wired."""

from __future__ import annotations

import os

from kvasir.config.cluster import worker_host
from kvasir.config.plan import Plan
from kvasir.errors import PlanError


def check_host(plan: Plan, here: str | None = None) -> None:
    """Refuse (PlanError) a plan this machine cannot run: absent CPUs or CUDA devices for
    the workers it runs (``here``: its host in a plan across hosts, default the leader),
    or workers split across hosts in a way this version cannot wire."""
    import torch

    usable = os.sched_getaffinity(0)
    cluster = plan.cluster
    here = here or (cluster.leader if cluster is not None else None)
    _check_split(plan)
    for pool, view in plan.pools():
        for index, stage in enumerate(view.stages):
            key = f"{pool}.stages[{index}]" if pool else f"stages[{index}]"
            if worker_host(cluster, stage.host) == here:
                _check_stage_host(key, stage, usable, torch)
            for j, shard in enumerate(stage.experts):  # expert shards: the same keys
                if worker_host(cluster, shard.host, stage.host) == here:
                    _check_stage_host(f"{key}.experts[{j}]", shard, usable, torch)


def _check_split(plan: Plan) -> None:
    """What crosses hosts in this version: ring edges (tcp). Not yet: an expert shard on
    another host than its stage, a KV hand-off between hosts."""
    cluster = plan.cluster
    if cluster is None:
        return
    for pool, view in plan.pools():
        for index, stage in enumerate(view.stages):
            key = f"{pool}.stages[{index}]" if pool else f"stages[{index}]"
            home = worker_host(cluster, stage.host)
            for j, shard in enumerate(stage.experts):
                if worker_host(cluster, shard.host, stage.host) != home:
                    raise PlanError(
                        f"{key}.experts[{j}].host = {shard.host!r}: this version runs an expert shard on its "
                        f"stage's host ({home}); dispatch between hosts is not built yet"
                    )
    if plan.disaggregated:
        pools = {name: {str(worker_host(cluster, stage.host)) for stage in view.stages} for name, view in plan.pools()}
        if len(pools["prefill"] | pools["decode"]) > 1:
            raise PlanError(
                "the prefill and decode pools run on hosts "
                f"{sorted(pools['prefill'])} and {sorted(pools['decode'])}: this version hands KV off "
                "within one host only (the hand-off between hosts is not built yet)"
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
