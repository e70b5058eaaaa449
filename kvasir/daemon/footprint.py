"""What each stage (and expert shard) of a plan will hold: parameters, KV cache, boundary
and dispatch slots and their kind.

Computed from the model's config alone (the skeleton is built on the meta device), so
a plan can be checked before any weights are read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from kvasir.config.cluster import worker_host
from kvasir.config.devices import DispatchKind, dispatch_kind, torch_dtype
from kvasir.config.fleet import Ring
from kvasir.config.plan import Plan
from kvasir.config.sections import Pool
from kvasir.model.kv_cache import PagedKVCache
from kvasir.model.loader import SliceModules, build_skeleton, count_parameters, slice_spec, stored_tensors
from kvasir.model.quant.stored import StoredBytes, stored_footprint
from kvasir.model.source import ModelSource
from kvasir.ring.edges import pool_edges, torch_peer_access
from kvasir.ring.expert_slots import dispatch_slot_bytes
from kvasir.units import GIB

StageRole = Literal["head", "middle", "tail"]


@dataclass(frozen=True)
class StageFootprint:
    index: int  # global: a disaggregated plan numbers the prefill pool's stages first
    pool: Pool
    instance: str  # its instance's name
    role: StageRole
    layers: tuple[int, int]
    device: str
    threads: int
    parameters: int
    parameter_bytes: int  # as held: the matrices served as stored in their packed form
    kv_bytes: int
    slot_bytes: int  # one boundary slot on the edge into this stage (0 on the head)
    slots: int  # slots in that edge's ring
    edge: str = (
        ""  # that edge's slot kind: shm | pinned | cuda-ipc | auto (undecided without CUDA here); "" on the head
    )
    edge_reason: str = ""
    host: str | None = None  # a plan with [cluster]: the host it runs on
    stored_bytes: int = 0  # of parameter_bytes, the GGUF matrices served as stored (model.weights)
    product_bytes: int = 0  # of parameter_bytes, what one batch reads: all but the embedding table (looked up by row)
    solo_threads: int | None = None  # threads for a batch alone in the ring (None: threads)


@dataclass(frozen=True)
class ShardFootprint:
    """An expert shard: its stage's experts ``experts`` for every MoE layer of the stage,
    and its dispatch slot (rows in: hidden states, expert ids, weights; partial sums out)."""

    number: int  # global, in plan order: shard-N
    stage: int  # its stage's global index
    experts: tuple[int, int]
    device: str
    threads: int
    parameters: int
    parameter_bytes: int
    dispatch_bytes: int
    dispatch_kind: DispatchKind = "shm"  # tcp: the shard is on another host
    host: str | None = None  # a plan with [cluster]: the host it runs on
    slots: int = 1  # a stage has one layer's rows out to a shard at a time


def shard_footprint(plan: Plan, source: ModelSource) -> list[ShardFootprint]:
    layout = source.moe
    out: list[ShardFootprint] = []
    if layout is None:
        return out
    dtype = torch_dtype(plan.model.dtype)
    for ring in plan.rings():
        view, first = ring.plan, ring.first
        for index, stage in enumerate(view.stages):
            layers = len(layout.moe_layers(stage.layers))
            for shard in stage.experts:
                params = layers * (shard.experts[1] - shard.experts[0]) * layout.expert_parameters()
                slot = dispatch_slot_bytes(view.batch.max_tokens, layout.hidden, layout.top_k, dtype.itemsize)
                host = worker_host(plan.cluster, shard.host, stage.host)
                out.append(
                    ShardFootprint(
                        len(out),
                        first + index,
                        shard.experts,
                        shard.device,
                        shard.threads,
                        params,
                        params * dtype.itemsize,
                        slot,
                        dispatch_kind(stage.device, shard.device, host == worker_host(plan.cluster, stage.host)),
                        host,
                    )  # fmt: skip
                )
    return out


def boundary_slot_bytes(plan: Plan, source: ModelSource) -> int:
    """The largest boundary any stage can return: max_tokens x hidden x dtype."""
    return plan.batch.max_tokens * int(source.config.hidden_size) * torch_dtype(plan.model.dtype).itemsize


def plan_footprint(plan: Plan, source: ModelSource) -> list[StageFootprint]:
    out: list[StageFootprint] = []
    for ring in plan.rings():
        out += _ring_footprint(ring, source)
    return out


def _table_bytes(skeleton: SliceModules, stored: StoredBytes, dtype: torch.dtype) -> int:
    """The bytes a head stage holds its embedding table in (0 elsewhere)."""
    if skeleton.embed_tokens is None:
        return 0
    return stored.tables or skeleton.embed_tokens.weight.numel() * dtype.itemsize


def _ring_footprint(ring: Ring[Plan], source: ModelSource) -> list[StageFootprint]:
    plan, first = ring.plan, ring.first
    dtype = torch_dtype(plan.model.dtype)
    slot = boundary_slot_bytes(plan, source)
    hosts = [worker_host(plan.cluster, stage.host) for stage in plan.stages]
    edges = pool_edges(plan.stages, torch_peer_access(plan.stages), hosts)
    out = []
    tensors = stored_tensors(source) if plan.model.weights == "as_stored" else None
    tied = source.tied_embeddings
    for index, stage in enumerate(plan.stages):
        spec = slice_spec(plan, index)
        skeleton = build_skeleton(source, spec)
        params = count_parameters(skeleton)
        stored = StoredBytes(0, 0, 0)
        if tensors is not None:
            stored = stored_footprint(skeleton, skeleton.checkpoint_name, tensors, tied, dtype)
        held = (params - stored.params) * dtype.itemsize + stored.held
        role: StageRole = "head" if spec.is_head else "tail" if spec.is_tail else "middle"
        kv = PagedKVCache.bytes_needed(
            stage.layers[1] - stage.layers[0],
            plan.kv.num_blocks,
            plan.kv.block_size,
            source.kv_heads,
            source.head_dim,
            dtype,
        )
        out.append(
            StageFootprint(
                index=first + index,
                pool=ring.pool,
                instance=ring.name,
                role=role,
                layers=stage.layers,
                device=stage.device,
                threads=stage.threads,
                parameters=params,
                parameter_bytes=held,
                product_bytes=held - _table_bytes(skeleton, stored, dtype),
                kv_bytes=kv,
                slot_bytes=0 if spec.is_head else slot,
                slots=0 if spec.is_head else plan.batch.inflight,
                edge="" if spec.is_head else edges[index - 1].kind,
                edge_reason="" if spec.is_head else edges[index - 1].reason,
                host=hosts[index],
                stored_bytes=stored.held,
                solo_threads=stage.solo_threads,
            )
        )
    return out


# -- the price of a hand-off (docs/architecture.md, The price of a hand-off) ---------------------
def kv_bytes_per_token(plan: Plan, source: ModelSource) -> int:
    """K and V of every layer for one prompt token: what a hand-off moves per token."""
    return PagedKVCache.bytes_needed(
        source.num_layers, 1, 1, source.kv_heads, source.head_dim, torch_dtype(plan.model.dtype)
    )


def handoff_ms(nbytes: int, link_gibps: float) -> float:
    """Transfer time at a constant effective bandwidth (binary units, no overhead, no overlap)."""
    return nbytes / (link_gibps * GIB) * 1000.0


def break_even_gibps(nbytes: int, interference_ms: float) -> float:
    """The bandwidth at which moving ``nbytes`` costs exactly the interference it avoids."""
    return nbytes / GIB / (interference_ms / 1000.0)
