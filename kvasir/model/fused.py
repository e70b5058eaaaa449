"""Fewer, larger matrix products: each layer's query/key/value projections become one
weight, and a dense MLP's gate and up projections another, once the weights are loaded.

On CPU a decode batch's projections read their weights from memory once per batch, so
one [hidden, q + 2 kv] product costs less than three (and one [hidden, 2 x intermediate]
less than two). The attention runs as Kvasir's layers do (kvasir/model/decoder.py): on
``[T, hidden]``, queries and keys rotated together, straight onto the paged cache. Each
architecture's attention keeps its own details: biases (Qwen2), per-head query/key
norms (Qwen3), and which sliding window transformers hands its attention function.
The modules hold the weights; once they are final a stage computes with their ``run``s,
plain functions of their tensors (kvasir/model/decoder.py, ``LayerRun``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvasir.model.attention import PagedBatch, attend
from kvasir.model.decoder import Norm, Rope, rotate
from kvasir.model.families import WindowRule, family_of
from kvasir.model.packed import PackedLinear
from kvasir.model.quant.linear import QuantLinear

Product = Callable[[torch.Tensor], torch.Tensor]


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


@dataclass(frozen=True, slots=True)
class AttentionRun:
    """A fused attention's forward as a plain function of its final tensors
    (kvasir/model/decoder.py, ``LayerRun``)."""

    qkv: Product
    o_proj: Product
    heads: int
    kv_heads: int
    head_dim: int
    layer_idx: int
    window: int | None
    scale: float
    q_norm: Norm | None  # with k_norm: both or neither (Qwen3)
    k_norm: Norm | None

    def __call__(self, hidden: torch.Tensor, rope: Rope, batch: PagedBatch) -> torch.Tensor:
        """``hidden`` [T, hidden] in and out."""
        tokens = hidden.shape[0]
        qkv = self.qkv(hidden).view(tokens, -1, self.head_dim)  # [T, heads + 2 kv_heads, dim]
        rotary, value = qkv.split((self.heads + self.kv_heads, self.kv_heads), dim=1)
        if self.q_norm is not None and self.k_norm is not None:  # per-head norms before the rotation
            query, key = rotary.split((self.heads, self.kv_heads), dim=1)
            rotary = torch.cat([self.q_norm(query), self.k_norm(key)], dim=1)
        query, key = rotate(rotary, rope).split((self.heads, self.kv_heads), dim=1)
        out = attend(batch, self.layer_idx, query, key, value, window=self.window, scale=self.scale)
        return self.o_proj(out.reshape(tokens, -1))


class FusedAttention(nn.Module):
    """A decoder layer's self-attention with one query/key/value product, on the paged
    cache; it holds the weights, ``run`` computes."""

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

    def run(self) -> AttentionRun:
        norms = (None, None) if self.q_norm is None else (Norm.of(self.q_norm), Norm.of(self.k_norm))
        return AttentionRun(
            product_of(self.qkv),
            product_of(self.o_proj),
            self.heads,
            self.kv_heads,
            self.head_dim,
            self.layer_idx,
            self.sliding_window,
            self.scaling,
            *norms,
        )


@dataclass(frozen=True, slots=True)
class MlpRun:
    """A fused MLP's forward as a plain function of its final tensors."""

    gate_up: Product
    down_proj: Product
    intermediate: int
    act: Product

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).split(self.intermediate, dim=-1)
        return self.down_proj(self.act(gate) * up)


class FusedMLP(nn.Module):
    """A dense gated MLP with one gate/up product; it holds the weights, ``run`` computes."""

    def __init__(self, mlp: Any) -> None:
        super().__init__()
        self.gate_up = _fused_linear([mlp.gate_proj, mlp.up_proj])
        self.intermediate = mlp.gate_proj.out_features
        self.down_proj = mlp.down_proj
        self.act_fn = mlp.act_fn

    def run(self) -> MlpRun:
        return MlpRun(product_of(self.gate_up), product_of(self.down_proj), self.intermediate, self.act_fn.forward)


def product_of(linear: nn.Module) -> Product:
    """A linear layer's product on [T, in_features] as a plain function of its tensors."""
    if isinstance(linear, QuantLinear | PackedLinear):
        return linear.product()
    if type(linear) is nn.Linear:
        return partial(F.linear, weight=linear.weight, bias=linear.bias)
    return linear.forward


def fuse_layers(layers: nn.ModuleList, model_type: str) -> None:
    """Replace each layer's attention, and each dense MLP, by its fused form (in place)."""
    family = family_of(model_type, "model")
    for layer in layers:
        layer.self_attn = FusedAttention(layer.self_attn, window(family.window, layer.self_attn))
        mlp = layer.mlp
        if all(hasattr(mlp, name) for name in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            layer.mlp = FusedMLP(mlp)
