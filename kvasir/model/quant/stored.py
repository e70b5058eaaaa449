"""Putting a stage's packed matrices, as stored, in place of its float layers.

On the stage's skeleton (still on the meta device) every linear layer and embedding whose
tensor is packed in a served format (a GGUF file's, kvasir/model/quant/ggml.py; a
quantized checkpoint's, kvasir/model/quant/checkpoint_formats.py) becomes a
``QuantLinear`` or ``QuantEmbedding`` holding that tensor's data; the float parts left
(norms, biases, tensors of other formats) are then filled from the model folder as
before (a GGUF's float32 copy in the cache). A tied LM head reads the embedding table's
tensor.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal, Protocol, cast

import numpy as np
import torch
from torch import nn

from kvasir.config.sections import Weights
from kvasir.errors import ModelSourceError
from kvasir.model.quant.ggml import BLOCK, BLOCK_BYTES, Format, Nibbles
from kvasir.model.quant.linear import QuantEmbedding, QuantLinear

EMBEDDINGS = "model.embed_tokens.weight"
FAST_DTYPE = "bfloat16"  # PyTorch's int4 CPU kernel is fast with these activations only (docs/bench/gguf.md)

Served = Literal["as_stored", "dequantize"]


class StoredTensors(Protocol):
    """Where packed matrices come from (kvasir/model/quant/gguf_weights.py,
    kvasir/model/quant/checkpoint_weights.py), by transformers' parameter names."""

    def stored_name(self, hf_name: str) -> str | None: ...

    def format(self, hf_name: str) -> str | None: ...

    def served(self, hf_name: str) -> str | None: ...

    def nibbles(self, hf_name: str) -> Nibbles: ...

    def blocks(self, hf_name: str) -> tuple[np.ndarray, Format, int]: ...

    def formats(self) -> Counter[str]: ...


def served_weights(
    weights: Weights, dtype: str, devices: Iterable[str], packed: bool, *, kernels: bool = True
) -> Served:
    """What ``model.weights`` comes to for a model (``packed``: its matrices come packed, from
    a GGUF file or a quantized checkpoint) whose workers run on ``devices``, where this
    torch has (``kernels``) or lacks the int4 CPU kernels: "auto" serves as stored where
    that is fast (bfloat16, every worker on the CPU, the kernels there); as stored off the
    CPU or without the kernels is refused."""
    if not packed or weights == "dequantize":
        return "dequantize"
    elsewhere = sorted({d for d in devices if d != "cpu"})
    if weights == "auto":
        return "as_stored" if dtype == FAST_DTYPE and not elsewhere and kernels else "dequantize"
    if elsewhere:
        raise ModelSourceError(
            f'model.weights = "as_stored" serves packed matrices on CPU stages only in this version, '
            f'not on {elsewhere[0]}: set model.weights = "dequantize"'
        )
    if not kernels:
        raise ModelSourceError(
            f'model.weights = "as_stored" needs PyTorch\'s int4 CPU kernels (aten._weight_int4pack_mm_for_cpu), '
            f'which torch {torch.__version__} lacks: set model.weights = "dequantize", or install a newer torch'
        )
    return "as_stored"


def check_weights(
    weights: Weights, dtype: str, devices: Iterable[str], packed: bool, *, kernels: bool = True
) -> Served:
    """``served_weights``, refusing also a plan that asks for as stored with activations the
    kernel is slow with (it would serve, many times slower than dequantised)."""
    served = served_weights(weights, dtype, devices, packed, kernels=kernels)
    if served == "as_stored" and dtype != FAST_DTYPE:
        raise ModelSourceError(
            f'model.weights = "as_stored" needs model.dtype = "{FAST_DTYPE}": PyTorch\'s int4 CPU kernel '
            f"runs 13 to 180 times slower with {dtype} activations than the dequantised weights (docs/bench/gguf.md)"
        )
    return served


@dataclass
class StoredLayers:
    """What a stage serves as stored: its tensors' formats and their bytes as held."""

    formats: Counter[str] = field(default_factory=Counter)
    stored_bytes: int = 0
    layers: list[str] = field(default_factory=list)  # checkpoint names of the tensors served as stored


def swap_stored(
    modules: nn.Module, checkpoint_name, tensors: StoredTensors, tied: bool, dtype: torch.dtype
) -> StoredLayers:
    """Replace, under ``modules``, each linear layer and embedding whose tensor is served
    as stored; ``checkpoint_name`` maps a local parameter name to its checkpoint name."""
    report = StoredLayers()
    for path, child, name, fmt in _candidates(modules, checkpoint_name, tensors, tied):
        report.formats[tensors.format(name) or "missing"] += 1
        if fmt is None:
            continue
        replacement: QuantLinear | QuantEmbedding
        if isinstance(child, nn.Linear):
            bias = None if child.bias is None else torch.empty(child.out_features, device="meta")
            weights = tensors.nibbles(name)
            _check_shape(name, (weights.out_features, weights.in_features), child)
            replacement = QuantLinear(weights, bias)
            report.stored_bytes += weights.held_bytes(dtype)
        else:
            raw, stored_format, width = tensors.blocks(name)
            _check_shape(name, (raw.shape[0], width), child)
            replacement = QuantEmbedding(raw, stored_format, child.embedding_dim, dtype)
            report.stored_bytes += replacement.stored_bytes
        report.layers.append(name)
        _replace(modules, path, replacement)
    return report


def _check_shape(name: str, stored: tuple[int, int], child: nn.Linear | nn.Embedding) -> None:
    """A stored matrix is [out, in] as the config makes the layer it replaces, or the stage refuses."""
    expected = tuple(child.weight.shape)
    if tuple(stored) != expected:
        raise ModelSourceError(f"tensor {name} is stored as {list(stored)}, the config expects {list(expected)}")


def _replace(modules: nn.Module, path: str, replacement: nn.Module) -> None:
    """Put ``replacement`` at ``path`` (dotted) under ``modules``."""
    parent, _, attribute = path.rpartition(".")
    setattr(modules.get_submodule(parent) if parent else modules, attribute, replacement)


@dataclass(frozen=True)
class StoredBytes:
    params: int  # parameters served as stored
    held: int  # their bytes as held
    tables: int  # of those bytes, the embedding tables' (looked up by row, not read whole by a batch)


def dequantize_stored(modules: nn.Module, dtype: torch.dtype, device: torch.device) -> int:
    """Replace every (unpacked) QuantLinear under ``modules`` by a float linear layer of
    ``dtype`` on ``device`` with its exact values; how many."""
    replaced = [(path, child) for path, child in modules.named_modules() if isinstance(child, QuantLinear)]
    for path, child in replaced:
        _replace(modules, path, child.as_float(dtype).to(device))
    return len(replaced)


def stored_footprint(
    modules: nn.Module, checkpoint_name, tensors: StoredTensors, tied: bool, dtype: torch.dtype
) -> StoredBytes:
    """Of ``modules`` (a skeleton: shapes only, nothing read), the parameters
    ``swap_stored`` would serve as stored and their bytes as held once packed: per plane
    half a byte a weight and a scale and a zero per group of 32 in ``dtype`` (a Q8_0
    matrix is two planes); an embedding table its file's blocks."""
    params = held = tables = 0
    for _, child, _, fmt in _candidates(modules, checkpoint_name, tensors, tied):
        if fmt is None:
            continue
        rows, width = child.weight.shape
        params += rows * width
        if isinstance(child, nn.Linear):
            planes = 2 if fmt == "Q8_0" else 1
            held += planes * (rows * width // 2 + rows * (width // BLOCK) * 2 * dtype.itemsize)
        else:
            tables += rows * (width // BLOCK) * BLOCK_BYTES[cast(Format, fmt)]  # tables: GGUF files only
    return StoredBytes(params, held + tables, tables)


def _candidates(modules: nn.Module, checkpoint_name, tensors: StoredTensors, tied: bool):
    """Every linear layer and embedding under ``modules``: (path, module, its checkpoint
    name, its tensor's format if served as stored, else None)."""
    for path, child in list(modules.named_modules()):
        if not isinstance(child, (nn.Linear, nn.Embedding)):
            continue
        name = checkpoint_name(f"{path}.weight")
        if name == "lm_head.weight" and tied and tensors.stored_name(name) is None:
            name = EMBEDDINGS
        yield path, child, name, tensors.served(name)
