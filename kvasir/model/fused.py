"""Fewer, larger matrix products: each layer's query/key/value projections become one
weight, and a dense MLP's gate and up projections another, once the weights are loaded.

On CPU a decode batch's projections read their weights from memory once per batch, so
one [hidden, q + 2 kv] product costs less than three (and one [hidden, 2 x intermediate]
less than two). The attention runs as Kvasir's layers do (kvasir/model/decoder.py): on
``[T, hidden]``, queries and keys rotated together, straight onto the paged cache. Each
architecture's attention keeps its own details: biases (Qwen2), per-head query/key
norms (Qwen3), and which sliding window transformers hands its attention function.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kvasir.model.attention import PagedBatch, attend
from kvasir.model.decoder import Rope, rms_norm, rotate
from kvasir.model.families import WindowRule, family_of
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
        self.heads = attention.q_proj.out_features // self.head_dim
        self.kv_heads = attention.k_proj.out_features // self.head_dim
        self.o_proj = attention.o_proj
        self.q_norm: Any = getattr(attention, "q_norm", None)
        self.k_norm: Any = getattr(attention, "k_norm", None)  # both or neither (Qwen3)

    def forward(self, hidden: torch.Tensor, rope: Rope, batch: PagedBatch) -> torch.Tensor:
        """``hidden`` [T, hidden] in and out."""
        tokens = hidden.shape[0]
        qkv = self.qkv(hidden).view(tokens, -1, self.head_dim)  # [T, heads + 2 kv_heads, dim]
        rotary, value = qkv.split((self.heads + self.kv_heads, self.kv_heads), dim=1)
        if self.q_norm is not None:  # per-head norms before the rotation
            query, key = rotary.split((self.heads, self.kv_heads), dim=1)
            rotary = torch.cat([rms_norm(self.q_norm, query), rms_norm(self.k_norm, key)], dim=1)
        query, key = rotate(rotary, rope).split((self.heads, self.kv_heads), dim=1)
        out = attend(batch, self.layer_idx, query, key, value, window=self.sliding_window, scale=self.scaling)
        return self.o_proj(out.reshape(tokens, -1))


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
    """Replace each layer's attention, and each dense MLP, by its fused form (in place)."""
    family = family_of(model_type, "model")
    for layer in layers:
        layer.self_attn = FusedAttention(layer.self_attn, window(family.window, layer.self_attn))
        mlp = layer.mlp
        if all(hasattr(mlp, name) for name in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            layer.mlp = FusedMLP(mlp)
