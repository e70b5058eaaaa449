"""Fewer, larger matrix products: each layer's query/key/value projections become one
weight, and a dense MLP's gate and up projections another, once the weights are loaded.

On CPU a decode batch's projections read their weights from memory once per batch, so
one [hidden, q + 2 kv] product costs less than three (and one [hidden, 2 x intermediate]
less than two); the attention forward also skips transformers' generic plumbing. Each
architecture's attention keeps its own details: biases (Qwen2), per-head query/key
norms (Qwen3), and which sliding window transformers hands its attention function.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from kvasir.model.attention import paged_attention
from kvasir.model.families import FAMILIES, WindowRule
from kvasir.model.quant.linear import QuantLinear


def window(rule: WindowRule, attention: Any) -> int | None:
    """The window a family's transformers attention passes to the attention function
    (kvasir/model/families.py says which rule each family follows)."""
    if rule == "module":
        return attention.sliding_window
    if rule == "config":
        return getattr(attention.config, "sliding_window", None)
    return None


def _fused_linear(parts: list[Any]) -> nn.Module:
    """One linear layer computing ``parts`` side by side (their outputs concatenated):
    stored 4-bit matrices stay stored when all parts are (kvasir/model/quant/linear.py),
    and are dequantised (exactly) to stack with float ones."""
    if all(isinstance(part, QuantLinear) for part in parts):
        return QuantLinear.stacked(parts)
    dtype = next(part.weight.dtype for part in parts if not isinstance(part, QuantLinear))
    parts = [part.as_float(dtype) if isinstance(part, QuantLinear) else part for part in parts]
    first = parts[0]
    bias = any(part.bias is not None for part in parts)
    outputs = sum(part.out_features for part in parts)
    fused = nn.Linear(first.in_features, outputs, bias=bias, device=first.weight.device, dtype=first.weight.dtype)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([part.weight for part in parts]))
        if bias:
            fused.bias.copy_(
                torch.cat(
                    [part.bias if part.bias is not None else part.weight.new_zeros(part.out_features) for part in parts]
                )
            )
    return fused


class FusedAttention(nn.Module):
    """A decoder layer's self-attention with one query/key/value product, on the paged cache."""

    def __init__(self, attention: Any, window: int | None) -> None:
        super().__init__()
        self.layer_idx = attention.layer_idx
        self.head_dim = attention.head_dim
        self.scaling = attention.scaling
        self.sliding_window = window
        self.qkv = _fused_linear([attention.q_proj, attention.k_proj, attention.v_proj])
        self.sizes = [attention.q_proj.out_features, attention.k_proj.out_features, attention.v_proj.out_features]
        self.o_proj = attention.o_proj
        self.q_norm: Any = getattr(attention, "q_norm", None)
        self.k_norm: Any = getattr(attention, "k_norm", None)  # both or neither (Qwen3)
        self.rotate = sys.modules[type(attention).__module__].apply_rotary_pos_emb

    def forward(
        self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor], **kwargs: Any
    ) -> tuple[torch.Tensor, None]:
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        query, key, value = (part.view(shape) for part in self.qkv(hidden_states).split(self.sizes, dim=-1))
        if self.q_norm is not None:
            query, key = self.q_norm(query), self.k_norm(key)
        query, key = self.rotate(query.transpose(1, 2), key.transpose(1, 2), *position_embeddings)
        out, _ = paged_attention(
            self,
            query,
            key,
            value.transpose(1, 2),
            None,
            scaling=self.scaling,
            sliding_window=self.sliding_window,
            kvasir=kwargs.get("kvasir"),
        )
        return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1)), None


class FusedMLP(nn.Module):
    """A dense gated MLP with one gate/up product."""

    def __init__(self, mlp: Any) -> None:
        super().__init__()
        self.gate_up = _fused_linear([mlp.gate_proj, mlp.up_proj])
        self.intermediate = mlp.gate_proj.out_features
        self.down_proj = mlp.down_proj
        self.act_fn = mlp.act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).split(self.intermediate, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)


def fuse_layers(layers: nn.ModuleList, model_type: str) -> None:
    """Replace each layer's attention, and each dense MLP, by its fused form (in place).
    An architecture without a known window rule is left as transformers builds it."""
    family = FAMILIES.get(model_type)
    if family is None:
        return
    for layer in layers:
        layer.self_attn = FusedAttention(layer.self_attn, window(family.window, layer.self_attn))
        mlp = layer.mlp
        if all(hasattr(mlp, name) for name in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            layer.mlp = FusedMLP(mlp)
