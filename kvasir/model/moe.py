"""Mixture-of-experts layers: the router, a range of experts, and Qwen2-MoE's shared expert.

In each MoE layer of a slice, transformers' sparse-MoE block is replaced by ``MoeBlock``,
whose experts are a ``LocalExperts`` module holding one contiguous range of expert ids
(all of them on a stage that runs its own experts, one range on an expert shard) or,
on a stage whose experts live on shards, whatever sends the routed rows there. The
arithmetic follows transformers' (softmax in float32, top-k, optional renormalising,
each expert's rows weighted and added in ascending expert order), so a stage's output
is the unsplit model's.

Checkpoints keep one tensor per expert (Mixtral ``block_sparse_moe.experts.E.w1/w3/w2``,
Qwen ``mlp.experts.E.gate_proj/up_proj/down_proj``); ``LocalExperts`` stacks its range's
into ``gate_up [n, 2*inter, hidden]`` and ``down [n, hidden, inter]``, and says which
checkpoint tensor fills which part (``Piece``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from kvasir.errors import KvasirError
from kvasir.model.moe_layout import MoeLayout


@dataclass(frozen=True)
class Piece:
    """One checkpoint tensor and where it goes in a parameter (``index`` None: all of it)."""

    stored: str
    index: tuple[Any, ...] | None = None


Collect = Callable[[], torch.Tensor]


class ExpertRunner(Protocol):
    """Runs a layer's routed experts: hidden [T, H], ids and weights [T, top_k] in; the
    returned call gives each token's weighted sum [T, H] (remote experts work meanwhile)."""

    def dispatch(self, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> Collect: ...


class MissingExperts:
    """The experts of a stage whose experts live on shards, until the shards are attached."""

    def dispatch(self, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> Collect:
        raise KvasirError("this stage's experts live on expert shards, and none are attached")


class LocalExperts(nn.Module):
    """The experts ``experts[0] <= e < experts[1]`` of one layer, stacked; ``routed``
    counts the tokens each has computed (an expert shard reports them)."""

    def __init__(self, layout: MoeLayout, experts: tuple[int, int], dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.layout = layout
        self.first, self.end = experts
        n = self.end - self.first
        self.gate_up = nn.Parameter(torch.empty(n, 2 * layout.inter, layout.hidden, dtype=dtype), requires_grad=False)
        self.down = nn.Parameter(torch.empty(n, layout.hidden, layout.inter, dtype=dtype), requires_grad=False)
        self.act = ACT2FN[layout.act]
        self.routed = [0] * n

    def pieces(self, layer: int) -> dict[str, list[Piece]]:
        """Which checkpoint tensor fills which part of ``gate_up`` and ``down``."""
        inter, name = self.layout.inter, self.layout.expert_tensor
        gate_up, down = [], []
        for row, expert in enumerate(range(self.first, self.end)):
            gate_up.append(Piece(name(layer, expert, "gate"), (row, slice(0, inter))))
            gate_up.append(Piece(name(layer, expert, "up"), (row, slice(inter, 2 * inter))))
            down.append(Piece(name(layer, expert, "down"), (row,)))
        return {"gate_up": gate_up, "down": down}

    def dispatch(self, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> Collect:
        out = self(hidden, ids, weights)
        return lambda: out

    def forward(self, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Each token's weighted sum over those of its top-k experts that are here, in
        ascending expert order; zero rows for tokens routed elsewhere."""
        out = torch.zeros_like(hidden)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.layout.num_experts)[self.first : self.end].tolist()
        start = int((flat < self.first).sum())
        top_k = ids.shape[1]
        for row, count in enumerate(counts):
            if count == 0:
                continue
            self.routed[row] += count
            picks = order[start : start + count]
            start += count
            tokens = picks // top_k
            gate, up = F.linear(hidden[tokens], self.gate_up[row]).chunk(2, dim=-1)
            value = F.linear(self.act(gate) * up, self.down[row])
            value = value * weights.reshape(-1)[picks, None]
            out.index_add_(0, tokens, value.to(out.dtype))
        return out


class MoeBlock(nn.Module):
    """A decoder layer's sparse-MoE MLP: routing here, experts wherever ``experts`` runs them.

    ``load`` counts the tokens routed to each expert (one per top-k pick), for the stage's
    expert-load statistics."""

    def __init__(self, layout: MoeLayout, hf_block: Any, experts: ExpertRunner) -> None:
        """``hf_block``: transformers' block, whose router weight and shared expert (its own
        modules, on the meta device until loaded) are kept."""
        super().__init__()
        self.layout = layout
        self.gate = hf_block.gate  # the router: .weight [num_experts, hidden]
        self.experts: Any = experts  # a LocalExperts module, or a runner of remote shards
        self.shared_expert: Any = hf_block.shared_expert if layout.shared else None
        self.shared_expert_gate: Any = hf_block.shared_expert_gate if layout.shared else None
        self.load: torch.Tensor | None = None

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert ids and weights [T, top_k] for hidden [T, H]."""
        logits = F.linear(hidden, self.gate.weight)
        probs = F.softmax(logits, dim=-1, dtype=torch.float)
        weights, ids = torch.topk(probs, self.layout.top_k, dim=-1)
        if self.layout.renormalise:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.layout.float32_weights:
            weights = weights.to(logits.dtype)
        return ids, weights

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        hidden = hidden_states.reshape(-1, shape[-1])
        ids, weights = self.route(hidden)
        self._count(ids)
        collect = self.experts.dispatch(hidden, ids, weights)
        shared = None  # computed while remote experts work
        if self.shared_expert is not None:
            shared = torch.sigmoid(self.shared_expert_gate(hidden)) * self.shared_expert(hidden)
        out = collect()
        if shared is not None:
            out = out + shared
        return out.reshape(shape)

    def _count(self, ids: torch.Tensor) -> None:
        counts = torch.bincount(ids.reshape(-1), minlength=self.layout.num_experts)
        self.load = counts if self.load is None else self.load + counts
