"""Linear layers and embeddings whose weights stay in their stored 4-bit form.

``QuantLinear`` multiplies by a :class:`~kvasir.model.quant.ggml.Nibbles` matrix with
PyTorch's grouped int4 CPU kernel (``aten._weight_int4pack_mm_for_cpu``: codes packed two
a byte, a scale and a zero per group of 32, the activations' dtype), reading half a byte
per weight plus its group's terms instead of four. Until ``pack`` it keeps its codes
unpacked, so a layer's query, key and value matrices (and a gated MLP's gate and up)
can still be stacked into one (kvasir/model/fused.py). ``QuantEmbedding`` keeps a GGUF
embedding table's blocks as stored and decodes only the rows a batch looks up.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np
import torch
from torch import nn

from kvasir.model.quant.ggml import BLOCK, Format, Nibbles, cat_rows, dequantize_rows

INNER_K_TILES = 2  # the packing's inner tiling (2 takes any row of whole groups of 32)
ROW_MULTIPLE = 16  # the kernel takes rows in sixteens: a matrix is padded with zero rows


def int4_kernels_available() -> bool:
    ops = torch.ops.aten
    return all(hasattr(ops, name) for name in ("_convert_weight_to_int4pack_for_cpu", "_weight_int4pack_mm_for_cpu"))


class QuantLinear(nn.Module):
    """``x @ w.T + b`` with ``w`` as Nibbles; unpacked until ``pack``."""

    packed: torch.Tensor  # buffers, once packed
    terms: torch.Tensor

    def __init__(self, weights: Nibbles, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.in_features = weights.in_features
        self.out_features = weights.out_features
        self.nibbles: Nibbles | None = weights  # not a buffer: to_empty/to(dtype) leave it be
        self.planes = weights.planes
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @staticmethod
    def stacked(parts: list[QuantLinear]) -> QuantLinear:
        """One layer computing ``parts`` side by side (outputs concatenated)."""
        weights = cat_rows([part.unpacked() for part in parts])
        biases = [p.bias if p.bias is not None else torch.zeros(p.out_features) for p in parts]
        bias = torch.cat([b.detach() for b in biases]) if any(p.bias is not None for p in parts) else None
        return QuantLinear(weights, bias)

    def unpacked(self) -> Nibbles:
        if self.nibbles is None:
            raise RuntimeError("a packed QuantLinear cannot be stacked")
        return self.nibbles

    def as_float(self, dtype: torch.dtype) -> nn.Linear:
        """The same layer with its weight dequantised (exact), for stacking with float layers."""
        weights = self.unpacked()
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, dtype=dtype)
        with torch.no_grad():
            linear.weight.copy_(weights.dequantize())
            if self.bias is not None:
                linear.bias.copy_(self.bias)
        return linear

    def pack(self, dtype: torch.dtype) -> None:
        """Pack the codes for the kernel, the group terms in the activations' ``dtype``."""
        weights = _padded(self.unpacked())
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(weights.codes.to(torch.int32), INNER_K_TILES)
        terms = torch.stack([weights.scale, weights.zero], dim=-1).transpose(0, 1).contiguous().to(dtype)
        self.register_buffer("packed", packed)
        self.register_buffer("terms", terms)  # [groups, N, 2]
        if self.bias is not None:
            self.bias = nn.Parameter(self.bias.detach().to(dtype), requires_grad=False)
        self.nibbles = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        return self.product()(flat).reshape(*x.shape[:-1], self.out_features)

    def product(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The packed layer's product on [T, in_features] as a plain function of its
        tensors (a stage's layers call it without the module: kvasir/model/decoder.py)."""
        return partial(
            _int4_product,
            packed=self.packed,
            terms=self.terms,
            planes=self.planes,
            out_features=self.out_features,
            bias=self.bias,
        )


def _int4_product(
    x: torch.Tensor,
    *,
    packed: torch.Tensor,
    terms: torch.Tensor,
    planes: int,
    out_features: int,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    if planes > 1:
        x = x.repeat(1, planes)
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, BLOCK, terms)
    if out.shape[1] != out_features:
        out = out[:, :out_features]
    return out if bias is None else out + bias


def _padded(weights: Nibbles) -> Nibbles:
    """``weights`` with zero rows (code 8, scale and zero 0) up to a multiple of ROW_MULTIPLE."""
    extra = -weights.out_features % ROW_MULTIPLE
    return cat_rows([weights, weights.zero_rows(extra)]) if extra else weights


class QuantEmbedding(nn.Module):
    """An embedding table kept as its GGUF blocks; a lookup decodes the rows it reads.
    The blocks are a plain attribute, not a buffer: they are real data on a module
    that is otherwise still to be materialised (``to_empty``) and filled."""

    def __init__(self, raw: np.ndarray, fmt: Format, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.format: Format = fmt
        self.embedding_dim = dim
        self.dtype = dtype
        self.blocks = torch.from_numpy(np.array(raw, dtype=np.uint8))  # a copy: the file may go
        self.stored_bytes = int(self.blocks.numel())

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows ``ids`` (1-D) in float32, exactly as stored."""
        raw = self.blocks.index_select(0, ids).numpy()
        return torch.from_numpy(dequantize_rows(raw, self.format, self.embedding_dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.rows(ids.reshape(-1)).to(self.dtype).view(*ids.shape, self.embedding_dim)


def pack_quantized(module: nn.Module, dtype: torch.dtype) -> int:
    """Pack every QuantLinear under ``module``; how many."""
    layers = [child for child in module.modules() if isinstance(child, QuantLinear)]
    for layer in layers:
        layer.pack(dtype)
    return len(layers)
