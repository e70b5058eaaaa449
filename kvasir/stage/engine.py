"""A stage's engine: its slice of the model and its paged KV cache, run on descriptors."""

from __future__ import annotations

from collections.abc import Collection

import torch

from kvasir.config.devices import cuda_ordinal, torch_dtype
from kvasir.config.plan import Plan
from kvasir.errors import BatchError
from kvasir.model.attention import build_batch
from kvasir.model.expert_dispatch import DispatchClock, ExpertShard, InProcessShard, ShardedExperts
from kvasir.model.host_index import input_to
from kvasir.model.kv_cache import PagedKVCache
from kvasir.model.loader import load_experts, load_slice, slice_spec
from kvasir.model.packed import pack_linears
from kvasir.model.source import ModelSource
from kvasir.model.stage_model import StageModel
from kvasir.wire.batch import BatchDescriptor


class StageEngine:
    """Runs batch descriptors through one stage: frees released KV, then the layers."""

    def __init__(
        self, plan: Plan, index: int, source: ModelSource, storage: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> None:
        """``index`` within the plan's ring; ``storage``: shared memory for the KV cache
        (a prefill stage's, which decode stages copy from)."""
        stage = plan.stages[index]
        self.index = index
        self.spec = slice_spec(plan, index)
        ordinal = cuda_ordinal(stage.device)
        self.device = torch.device("cpu") if ordinal is None else torch.device("cuda", ordinal)  # "cuda" is cuda:0
        dtype = torch_dtype(plan.model.dtype)
        modules, self.tensors_read = load_slice(source, self.spec, dtype, self.device, plan.model.weights)
        self.packed = pack_linears(modules)
        self.dispatch = DispatchClock()
        self.model = StageModel(modules, source, self.device, plan.model.max_seq_len)
        self.cache = PagedKVCache(
            num_layers=stage.layers[1] - stage.layers[0],
            num_blocks=plan.kv.num_blocks,
            block_size=plan.kv.block_size,
            kv_heads=source.kv_heads,
            head_dim=source.head_dim,
            dtype=dtype,
            device=self.device,
            storage=storage,
        )

    def attach(self, shards: list[ExpertShard]) -> None:
        """Run this stage's MoE layers' experts on ``shards`` (ranges in expert order)."""
        for layer, block in self.model.slice.moe_blocks():
            block.experts = ShardedExperts(layer, shards, self.dispatch)

    def expert_load(self) -> list[int]:
        """Tokens routed to each expert over the stage's MoE layers so far ([] if none)."""
        counts = [block.load for _, block in self.model.slice.moe_blocks() if block.load is not None]
        return torch.stack(counts).sum(dim=0).tolist() if counts else []

    def release(self, descriptor: BatchDescriptor) -> None:
        """Free the KV of the requests the descriptor releases."""
        self.cache.release(descriptor.release)

    def run(self, descriptor: BatchDescriptor, inputs: torch.Tensor, scored: Collection[int] = ()) -> torch.Tensor:
        """Token ids [T] on the head, boundary [T, hidden] elsewhere; returns the stage output
        (the tail's: logits of the emitting rows, then of every token of ``scored`` rows).

        Releases are applied first; the caller handles release-only descriptors (no
        rows) with ``release`` alone.
        """
        total = sum(row.num_tokens for row in descriptor.rows)
        if total != descriptor.num_tokens or inputs.shape[0] != total or not descriptor.rows:
            raise BatchError(
                f"batch {descriptor.batch_id}: {len(descriptor.rows)} rows hold {total} tokens, "
                f"descriptor says {descriptor.num_tokens}, input has {inputs.shape[0]}"
            )
        self.release(descriptor)
        batch = build_batch(self.cache, self.spec.layers[0], descriptor.rows, scored)
        return self.model(input_to(self.device, inputs), batch)


def in_process_shards(plan: Plan, index: int, source: ModelSource, device: torch.device) -> list[ExpertShard]:
    """Stage ``index``'s expert shards, loaded into this process (the in-process chain)."""
    stage = plan.stages[index]
    dtype = torch_dtype(plan.model.dtype)
    return [
        InProcessShard(shard.experts, load_experts(source, stage.layers, shard.experts, dtype, device))
        for shard in stage.experts
    ]
