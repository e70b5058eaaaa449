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

from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

MoeFamily = Literal["mixtral", "qwen2_moe", "qwen3_moe"]
MOE_MODEL_TYPES: tuple[MoeFamily, ...] = ("mixtral", "qwen2_moe", "qwen3_moe")


@dataclass(frozen=True)
class Piece:
    """One checkpoint tensor and where it goes in a parameter (``index`` None: all of it)."""

    stored: str
    index: tuple[Any, ...] | None = None


@dataclass(frozen=True)
class MoeLayout:
    """How a model family lays out its MoE layers, read from its config."""

    family: MoeFamily
    num_experts: int
    top_k: int
    renormalise: bool  # scale the top-k weights to sum to 1
    float32_weights: bool  # Mixtral keeps the routing weights in float32; Qwen casts them
    hidden: int
    inter: int  # one expert's intermediate size
    act: str
    shared: bool  # Qwen2-MoE: a shared expert and its sigmoid gate
    sparse_step: int
    dense_layers: frozenset[int]

    @classmethod
    def of(cls, config: Any) -> MoeLayout | None:
        """The layout of a config's MoE layers; None for a dense model."""
        family = config.model_type
        if family == "mixtral":
            return cls(
                "mixtral", int(config.num_local_experts), int(config.num_experts_per_tok), True, True,
                int(config.hidden_size), int(config.intermediate_size), config.hidden_act, False, 1, frozenset(),
            )  # fmt: skip
        if family in ("qwen2_moe", "qwen3_moe"):
            return cls(
                family, int(config.num_experts), int(config.num_experts_per_tok), bool(config.norm_topk_prob),
                False, int(config.hidden_size), int(config.moe_intermediate_size), config.hidden_act,
                family == "qwen2_moe", int(config.decoder_sparse_step), frozenset(config.mlp_only_layers or ()),
            )  # fmt: skip
        return None

    def is_moe(self, layer: int) -> bool:
        """Whether a layer's MLP is a sparse-MoE block (transformers' rule per family)."""
        return self.num_experts > 0 and layer not in self.dense_layers and (layer + 1) % self.sparse_step == 0

    def moe_layers(self, layers: tuple[int, int]) -> list[int]:
        return [layer for layer in range(*layers) if self.is_moe(layer)]

    @property
    def prefix(self) -> str:
        """The MoE block's name inside a checkpoint's decoder layer."""
        return "block_sparse_moe" if self.family == "mixtral" else "mlp"

    def expert_tensor(self, layer: int, expert: int, part: Literal["gate", "up", "down"]) -> str:
        names = {"gate": "w1", "up": "w3", "down": "w2"} if self.family == "mixtral" else {}
        leaf = names.get(part, f"{part}_proj")
        return f"model.layers.{layer}.{self.prefix}.experts.{expert}.{leaf}.weight"

    def expert_parameters(self) -> int:
        return 3 * self.hidden * self.inter


class ExpertRunner(Protocol):
    """Computes the routed experts' sum for each token: hidden [T, H], ids and weights
    [T, top_k] in, [T, H] out."""

    def __call__(self, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor: ...


class LocalExperts(nn.Module):
    """The experts ``experts[0] <= e < experts[1]`` of one layer, stacked."""

    def __init__(self, layout: MoeLayout, experts: tuple[int, int], dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.layout = layout
        self.first, self.end = experts
        n = self.end - self.first
        self.gate_up = nn.Parameter(torch.empty(n, 2 * layout.inter, layout.hidden, dtype=dtype), requires_grad=False)
        self.down = nn.Parameter(torch.empty(n, layout.hidden, layout.inter, dtype=dtype), requires_grad=False)
        self.act = ACT2FN[layout.act]

    def pieces(self, layer: int) -> dict[str, list[Piece]]:
        """Which checkpoint tensor fills which part of ``gate_up`` and ``down``."""
        inter, name = self.layout.inter, self.layout.expert_tensor
        gate_up, down = [], []
        for row, expert in enumerate(range(self.first, self.end)):
            gate_up.append(Piece(name(layer, expert, "gate"), (row, slice(0, inter))))
            gate_up.append(Piece(name(layer, expert, "up"), (row, slice(inter, 2 * inter))))
            down.append(Piece(name(layer, expert, "down"), (row,)))
        return {"gate_up": gate_up, "down": down}

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
            picks = order[start : start + count]
            start += count
            tokens = picks // top_k
            gate, up = F.linear(hidden[tokens], self.gate_up[row]).chunk(2, dim=-1)
            value = F.linear(self.act(gate) * up, self.down[row])
            value = value * weights.reshape(-1)[picks, None]
            out.index_add_(0, tokens, value.to(out.dtype))
        return out


class MoeBlock(nn.Module):
    """A decoder layer's sparse-MoE MLP: routing here, experts wherever ``experts`` runs them."""

    def __init__(self, layout: MoeLayout, hf_block: Any, experts: nn.Module) -> None:
        """``hf_block``: transformers' block, whose router weight and shared expert (its own
        modules, on the meta device until loaded) are kept."""
        super().__init__()
        self.layout = layout
        self.gate = hf_block.gate  # the router: .weight [num_experts, hidden]
        self.experts = experts
        self.shared_expert: Any = hf_block.shared_expert if layout.shared else None
        self.shared_expert_gate: Any = hf_block.shared_expert_gate if layout.shared else None

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
        shared = self.shared_expert(hidden) if self.shared_expert is not None else None
        ids, weights = self.route(hidden)
        out = self.experts(hidden, ids, weights)
        if shared is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(hidden)) * shared
        return out.reshape(shape)
