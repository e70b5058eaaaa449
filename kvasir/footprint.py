"""What each stage of a plan will hold: parameters, KV cache, boundary slots.

Computed from the model's config alone (the skeleton is built on the meta device), so
a plan can be checked before any weights are read.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvasir.engine import head_dim, slice_spec
from kvasir.model.kv_cache import PagedKVCache
from kvasir.model.loader import DTYPES, build_skeleton, count_parameters
from kvasir.model.source import ModelSource
from kvasir.plan import Plan


@dataclass(frozen=True)
class StageFootprint:
    index: int
    role: str  # head | middle | tail
    layers: tuple[int, int]
    device: str
    threads: int
    parameters: int
    parameter_bytes: int
    kv_bytes: int
    slot_bytes: int  # one boundary slot on the edge into this stage (0 on the head)
    slots: int  # slots in that edge's ring


def boundary_slot_bytes(plan: Plan, source: ModelSource) -> int:
    """The largest boundary any stage can return: max_tokens x hidden x dtype."""
    return plan.batch.max_tokens * int(source.config.hidden_size) * DTYPES[plan.model.dtype].itemsize


def plan_footprint(plan: Plan, source: ModelSource) -> list[StageFootprint]:
    dtype = DTYPES[plan.model.dtype]
    config = source.config
    slot = boundary_slot_bytes(plan, source)
    out = []
    for index, stage in enumerate(plan.stages):
        spec = slice_spec(plan, index)
        params = count_parameters(build_skeleton(source, spec))
        role = "head" if spec.is_head else "tail" if spec.is_tail else "middle"
        kv = PagedKVCache.bytes_needed(
            stage.layers[1] - stage.layers[0],
            plan.kv.num_blocks,
            plan.kv.block_size,
            int(config.num_key_value_heads),
            head_dim(config),
            dtype,
        )
        out.append(
            StageFootprint(
                index=index,
                role=role,
                layers=stage.layers,
                device=stage.device,
                threads=stage.threads,
                parameters=params,
                parameter_bytes=params * dtype.itemsize,
                kv_bytes=kv,
                slot_bytes=0 if spec.is_head else slot,
                slots=0 if spec.is_head else plan.batch.inflight,
            )
        )
    return out
