"""A stage's MoE layers with their experts on shards: which rows go to which shard, and
how the shards' partial sums come back together.

For each MoE layer the stage routes, then hands each shard only the tokens with at least
one pick among that shard's experts (hidden states, expert ids, routing weights); a
shard no token was routed to gets nothing. Every shard works at once; their partial sums
are added in shard order (fixed, so results are deterministic). Where the shards run (in
this process for the in-process chain, in shard processes for the daemon) is the
``ExpertShard`` behind it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import torch

from kvasir.model.moe import Collect, LocalExperts


class ExpertShard(Protocol):
    """One shard's experts ``experts = (first, end)`` of every MoE layer of a stage."""

    experts: tuple[int, int]

    def start(self, layer: int, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> None:
        """Begin the layer's rows (hidden [R, H], ids and weights [R, top_k])."""

    def finish(self, layer: int) -> torch.Tensor:
        """The started rows' partial sums [R, H], in the order they were sent."""
        ...


@dataclass
class DispatchClock:
    """Seconds a stage spent dispatching rows and combining results (waits included)."""

    seconds: float = 0.0


class ShardedExperts:
    """The ``experts`` of one MoE layer of a stage whose experts live on ``shards``."""

    def __init__(self, layer: int, shards: list[ExpertShard], clock: DispatchClock) -> None:
        self.layer = layer
        self.shards = shards
        self.clock = clock

    def dispatch(self, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> Collect:
        started = time.perf_counter()
        sent: list[tuple[ExpertShard, torch.Tensor]] = []
        for shard in self.shards:
            first, end = shard.experts
            rows = ((ids >= first) & (ids < end)).any(dim=1).nonzero().squeeze(1)
            if rows.numel():
                shard.start(self.layer, hidden[rows], ids[rows], weights[rows])
                sent.append((shard, rows))
        self.clock.seconds += time.perf_counter() - started

        def collect() -> torch.Tensor:
            began = time.perf_counter()
            out = torch.zeros_like(hidden)
            for shard, rows in sent:
                out.index_add_(0, rows, shard.finish(self.layer))
            self.clock.seconds += time.perf_counter() - began
            return out

        return collect


class InProcessShard:
    """A shard's experts in the calling process (the in-process chain): computed at once."""

    def __init__(self, experts: tuple[int, int], bank: dict[int, LocalExperts]) -> None:
        self.experts = experts
        self.bank = bank
        self._done: dict[int, torch.Tensor] = {}

    def start(self, layer: int, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> None:
        self._done[layer] = self.bank[layer](hidden, ids, weights)

    def finish(self, layer: int) -> torch.Tensor:
        return self._done.pop(layer)
