"""A decoder layer's forward, run by Kvasir on transformers' own modules.

Every family Kvasir serves (kvasir/model/families.py) has transformers' pre-norm decoder
layer: ``h = x + attention(norm(x))``, then ``h + mlp(norm(h))``. The stages keep
transformers' modules (their weights, norms, MLPs and Kvasir's MoE blocks) and run that
structure themselves on the packed batch as ``[T, hidden]``: transformers' layer call
adds keyword plumbing and a deprecation wrapper per layer, and its rotary embedding
builds each rotated half with a slice, a negation and a concatenation, for queries and
keys apart. Here the rotary tables are built once per batch (``Rope``) and queries and
keys rotate together in four operations. Each step is the same arithmetic, in the same
order and dtype, as transformers', so the outputs are bit-identical: the rotation and the
norm are checked against every family's own (tests/unit/model/test_decoder.py), whole
models against ``generate`` (tests/unit/stage/test_chain.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F


class Rope(NamedTuple):
    """One batch's rotary tables, ``[T, 1, head_dim]`` (broadcast over heads)."""

    cos: torch.Tensor
    sin: torch.Tensor  # first half negated: rotate_half(x) * sin == x.roll(half) * this


def rope_tables(cos: torch.Tensor, sin: torch.Tensor) -> Rope:
    """From a transformers rotary embedding's ``[1, T, head_dim]`` cos and sin."""
    half = cos.shape[-1] // 2
    signed = torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1)
    return Rope(cos[0, :, None], signed[:, None])


class RotaryTables:
    """A stage's rotary tables for positions [0, ``positions``), made once by the model's
    own rotary module: each angle is one product of a position and a frequency, so a
    position's row is the same whatever batch it is computed in, and a batch looks its
    rows up (two operations where the module takes about fifteen). An embedding whose
    frequencies depend on the batch's longest position (dynamic NTK, long-rope) is called
    per batch, as is any batch reaching past the tables."""

    def __init__(self, rotary: Any, dtype: torch.dtype, device: torch.device, positions: int) -> None:
        self.rotary = rotary
        kind = getattr(rotary, "rope_type", "default")
        self.tables: Rope | None = None
        if isinstance(kind, str) and "dynamic" not in kind and kind != "longrope":
            probe = torch.empty(0, dtype=dtype, device=device)
            self.tables = rope_tables(*rotary(probe, torch.arange(positions, device=device)[None]))
        self.positions = positions

    def __call__(self, hidden: torch.Tensor, positions: torch.Tensor, end: int) -> Rope:
        """The rows of ``positions`` [T] (``end``: one past the largest)."""
        if self.tables is None or end > self.positions:
            return rope_tables(*self.rotary(hidden, positions[None]))
        return Rope(self.tables.cos.index_select(0, positions), self.tables.sin.index_select(0, positions))


def rotate(x: torch.Tensor, rope: Rope) -> torch.Tensor:
    """``x`` [T, heads, head_dim] with the rotary embedding applied, as transformers'
    ``x * cos + rotate_half(x) * sin`` (negating a factor is exact, so the products match)."""
    return x * rope.cos + x.roll(x.shape[-1] // 2, -1) * rope.sin


@dataclass(frozen=True, slots=True)
class Norm:
    """A transformers RMS norm's weight and epsilon, applied as ``rms_norm`` does."""

    weight: torch.Tensor
    eps: float

    @staticmethod
    def of(norm: Any) -> Norm:
        return Norm(norm.weight, norm.variance_epsilon)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * F.rms_norm(x, (x.shape[-1],), None, self.eps)


def rms_norm(norm: Any, x: torch.Tensor) -> torch.Tensor:
    """A transformers RMS norm module's output: normalised in float32, back to ``x``'s
    dtype, then scaled by the module's weight (``F.rms_norm`` computes in float32 and
    rounds once, as transformers' casts do: the same bits, in one call instead of three)."""
    return norm.weight * F.rms_norm(x, (x.shape[-1],), None, norm.variance_epsilon)


@dataclass(frozen=True, slots=True)
class LayerRun:
    """One decoder layer as plain functions of its final tensors: the norms, the fused
    attention's and MLP's runs (kvasir/model/fused.py), or an MoE block's ``forward``.
    Made once a stage's weights are final (loaded, fused, packed); a module call and a
    module attribute lookup cost about a microsecond each, and a layer made some 25 a
    token (docs/bench/latency.md: about 1 ms of a 12 ms decode step)."""

    attention_norm: Norm
    attention: Callable[[torch.Tensor, Rope, Any], torch.Tensor]
    mlp_norm: Norm
    mlp: Callable[[torch.Tensor], torch.Tensor]

    @staticmethod
    def of(layer: Any) -> LayerRun:
        """``layer.self_attn`` is Kvasir's fused attention; ``layer.mlp`` a fused MLP or an
        MoE block."""
        mlp = layer.mlp
        run = mlp.run() if hasattr(mlp, "run") else mlp.forward
        return LayerRun(
            Norm.of(layer.input_layernorm), layer.self_attn.run(), Norm.of(layer.post_attention_layernorm), run
        )


def decoder_layer(layer: LayerRun, hidden: torch.Tensor, rope: Rope, batch: Any) -> torch.Tensor:
    """One layer on ``hidden`` [T, hidden]; ``batch`` its paged batch."""
    hidden = hidden + layer.attention(layer.attention_norm(hidden), rope, batch)
    return hidden + layer.mlp(layer.mlp_norm(hidden))
