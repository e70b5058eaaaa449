"""A stage and its expert shards (``ExpertMessage`` both ways; the rows themselves sit in
the shard's dispatch slot, kvasir/ring/expert_slots.py)."""

from __future__ import annotations

from kvasir.wire.base import Tagged


class ExpertWork(Tagged, frozen=True):
    """Stage -> shard: the slot holds ``rows`` rows of MoE layer ``layer``; compute them."""

    seq: int  # the stage's count of dispatches to this shard
    layer: int  # the model's layer index
    rows: int


class ExpertDone(Tagged, frozen=True):
    """Shard -> stage: the partial sums of dispatch ``seq`` are in the slot's output."""

    seq: int
    shard: int  # the shard's number
    rows: int


ExpertMessage = ExpertWork | ExpertDone
