"""Expert shards in a plan: a stage may spread its MoE layers' experts over worker
processes (``[[stages.experts]]``), each holding one contiguous range of expert ids for
every MoE layer of the stage.

``check_shards`` checks what can be checked without the model (each range non-empty,
the ranges contiguous from 0); ``check_shards_fit`` checks them against the model (a
mixture of experts, the stage holds MoE layers, the ranges end at its expert count).
"""

from __future__ import annotations

from collections.abc import Collection

import msgspec

from kvasir.config.resources import check_placement
from kvasir.errors import PlanError


class ShardSpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    experts: tuple[int, int]  # half-open range of expert ids, the same for every MoE layer of the stage
    device: str = "cpu"
    threads: int = 1
    cpus: tuple[int, ...] | None = None
    host: str | None = None  # a [hosts.NAME] of the plan (default: its stage's host)


def check_shards(key: str, shards: tuple[ShardSpec, ...]) -> None:
    """``key``: the stage's table, e.g. ``stages[0]``."""
    end = 0
    for j, shard in enumerate(shards):
        name = f"{key}.experts[{j}]"
        start, stop = shard.experts
        if stop <= start or start < 0:
            raise PlanError(
                f"{name}.experts = [{start}, {stop}] is not a non-empty half-open range [start, end) "
                "with 0 <= start < end"
            )
        if start != end:
            where = "the first shard's range must start at 0" if j == 0 else f"the previous shard's ends at {end}"
            raise PlanError(f"{name}.experts = [{start}, {stop}] starts at {start}, but {where}: ranges are contiguous")
        end = stop
        check_placement(name, shard.device, shard.threads, shard.cpus)


def check_shards_fit(
    key: str, layers: tuple[int, int], shards: tuple[ShardSpec, ...], num_experts: int, moe_layers: Collection[int]
) -> None:
    """Against the model: ``num_experts`` 0 for a dense model; ``moe_layers`` its MoE layers."""
    if not shards:
        return
    if num_experts == 0:
        raise PlanError(f"{key}.experts: the model is not a mixture of experts: it has no experts to shard")
    if not any(layers[0] <= layer < layers[1] for layer in moe_layers):
        raise PlanError(f"{key}.experts: layers [{layers[0]}, {layers[1]}) hold no MoE layer: nothing to shard")
    last = len(shards) - 1
    start, end = shards[-1].experts
    if end > num_experts:
        raise PlanError(f"{key}.experts[{last}].experts = [{start}, {end}] goes past the model's {num_experts} experts")
    if end < num_experts:
        raise PlanError(
            f"{key}.experts[{last}].experts ends at {end}: experts [{end}, {num_experts}) of the model's "
            f"{num_experts} are on no shard"
        )
