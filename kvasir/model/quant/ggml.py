"""GGML's block formats that Kvasir serves as stored, decoded into one common form.

A GGUF matrix of ``N`` rows and ``K`` columns is stored row by row in blocks of 32
values along the row. Three formats are served packed (the others are dequantised):

- ``Q4_0``: 18 bytes a block: scale ``d`` (float16), 16 bytes of 4-bit codes; ``w = d (q - 8)``.
- ``Q4_1``: 20 bytes: ``d``, minimum ``m`` (float16), 16 bytes of codes; ``w = d q + m``.
- ``Q8_0``: 34 bytes: ``d``, 32 signed bytes; ``w = d q``.

Byte ``j`` of a block's codes holds value ``j`` in its low nibble and value ``j + 16`` in
its high one. All three become :class:`Nibbles`: 4-bit codes with a scale and a zero per
group of 32, ``w = (code - 8) scale + zero`` — the form PyTorch's grouped int4 CPU kernel
multiplies by (kvasir/model/quant/linear.py). ``Q4_1`` maps onto it exactly (``scale = d``,
``zero = m + 8 d``), ``Q4_0`` too (``zero = 0``). A ``Q8_0`` value splits into two nibbles,
``q = 16 hi + lo`` with ``hi`` in [-8, 7] and ``lo`` in [0, 15], so a ``Q8_0`` matrix is two
planes side by side along the row: ``hi + 8`` with scale ``16 d`` and zero 0, then ``lo``
with scale ``d`` and zero ``8 d``; multiplying ``[x, x]`` by both planes sums to ``x w``.
Every step is exact: the products differ from the dequantised float32 matrix's only by
the order of float32 additions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np
import torch

Format = Literal["Q4_0", "Q4_1", "Q8_0"]
FORMATS: tuple[Format, ...] = get_args(Format)
BLOCK = 32  # values per block, and per group of Nibbles
BLOCK_BYTES: dict[Format, int] = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}


@dataclass(frozen=True)
class Nibbles:
    """A matrix as 4-bit codes with a scale and a zero per group of 32 along each row:
    ``w[n, k] = (codes[n, k] - 8) * scale[n, k // 32] + zero[n, k // 32]``, summed over
    ``planes`` blocks of ``in_features`` columns each."""

    codes: torch.Tensor  # uint8 [N, planes * in_features], values 0..15
    scale: torch.Tensor  # float32 [N, planes * in_features / 32]
    zero: torch.Tensor  # float32, as scale
    in_features: int
    planes: int  # 1 (Q4_0, Q4_1) or 2 (Q8_0)

    @property
    def out_features(self) -> int:
        return int(self.codes.shape[0])

    def rows(self, order: torch.Tensor) -> Nibbles:
        """The same matrix with its rows in ``order``."""
        return Nibbles(self.codes[order], self.scale[order], self.zero[order], self.in_features, self.planes)

    def as_planes(self, planes: int) -> Nibbles:
        """The same matrix over ``planes`` planes (the added ones all zero: code 8, scale 0)."""
        extra = planes - self.planes
        if extra < 0:
            raise ValueError(f"a matrix of {self.planes} planes cannot become {planes}")
        if extra == 0:
            return self
        pad = self.zero_rows(self.out_features, extra)
        codes, scale, zero = (torch.cat(pair, dim=1) for pair in zip(self.tensors, pad.tensors, strict=True))
        return Nibbles(codes, scale, zero, self.in_features, planes)

    def zero_rows(self, rows: int, planes: int | None = None) -> Nibbles:
        """``rows`` rows of zeros (code 8, scale and zero 0) of this matrix's width, over
        ``planes`` planes (default: as many as this one)."""
        planes = self.planes if planes is None else planes
        groups = planes * self.in_features // BLOCK
        codes = self.codes.new_full((rows, planes * self.in_features), 8)
        return Nibbles(
            codes, self.scale.new_zeros(rows, groups), self.zero.new_zeros(rows, groups), self.in_features, planes
        )

    @property
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.codes, self.scale, self.zero

    def dequantize(self) -> torch.Tensor:
        """The float32 matrix [N, in_features]."""
        n = self.out_features
        values = (self.codes.float() - 8).view(n, -1, BLOCK) * self.scale[..., None] + self.zero[..., None]
        return values.view(n, self.planes, self.in_features).sum(dim=1)

    def held_bytes(self, dtype: torch.dtype) -> int:
        """Bytes as served once packed: two codes a byte, a scale and a zero per group in
        ``dtype`` (the activations')."""
        return self.codes.numel() // 2 + dtype.itemsize * (self.scale.numel() + self.zero.numel())


def cat_rows(parts: list[Nibbles]) -> Nibbles:
    """Matrices of the same width stacked row-wise (fewer planes are widened first)."""
    planes = max(part.planes for part in parts)
    widths = {part.in_features for part in parts}
    if len(widths) != 1:
        raise ValueError(f"cannot stack matrices of widths {sorted(widths)}")
    parts = [part.as_planes(planes) for part in parts]
    codes, scale, zero = (torch.cat(column) for column in zip(*(part.tensors for part in parts), strict=True))
    return Nibbles(codes, scale, zero, parts[0].in_features, planes)


def decode(raw: np.ndarray, fmt: Format, in_features: int) -> Nibbles:
    """A GGUF matrix's bytes ([N, bytes per row], uint8) as Nibbles."""
    if in_features % BLOCK:
        raise ValueError(f"a {fmt} row of {in_features} values is not whole blocks of {BLOCK}")
    groups = in_features // BLOCK
    data = np.ascontiguousarray(raw, dtype=np.uint8)
    if data.ndim != 2 or data.shape[1] != groups * BLOCK_BYTES[fmt]:
        raise ValueError(f"{fmt} data of shape {data.shape} does not hold rows of {in_features} values")
    blocks = data.reshape(data.shape[0], groups, BLOCK_BYTES[fmt])
    d = _half(blocks, 0)
    if fmt == "Q8_0":
        return _two_planes(blocks[..., 2:].view(np.int8), d, in_features)
    codes = _four_bit_codes(blocks, fmt).reshape(data.shape[0], in_features)
    zero = _half(blocks, 2) + 8 * d if fmt == "Q4_1" else torch.zeros_like(d)
    return Nibbles(torch.from_numpy(codes), d, zero, in_features, 1)


def dequantize_rows(raw: np.ndarray, fmt: Format, in_features: int) -> np.ndarray:
    """A few rows' bytes ([N, bytes per row], uint8) as float32 values [N, in_features],
    straight from the blocks (GGML's own arithmetic, the values ``decode(...).dequantize()``
    gives): an embedding lookup's few rows in a handful of NumPy operations."""
    groups = in_features // BLOCK
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, groups, BLOCK_BYTES[fmt])
    d = _float16s(blocks, 0)
    if fmt == "Q8_0":
        values = d * blocks[..., 2:].view(np.int8).astype(np.float32)
    else:
        codes = _four_bit_codes(blocks, fmt).astype(np.float32)
        values = d * codes + _float16s(blocks, 2) if fmt == "Q4_1" else d * (codes - 8)
    return values.reshape(-1, in_features)


def _float16s(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The float16 at ``offset`` of every block, as float32 [N, groups, 1]."""
    return np.ascontiguousarray(blocks[..., offset : offset + 2]).view(np.float16).astype(np.float32)


def _half(blocks: np.ndarray, offset: int) -> torch.Tensor:
    """The float16 at ``offset`` of every block, as float32 [N, groups]."""
    return torch.from_numpy(_float16s(blocks, offset).squeeze(-1))


def _four_bit_codes(blocks: np.ndarray, fmt: Format) -> np.ndarray:
    """A Q4_0 or Q4_1 block's 32 codes in value order: byte ``j``'s low nibble is value
    ``j``, its high nibble value ``j + 16``; uint8 [N, groups, 32]."""
    quants = blocks[..., 4:] if fmt == "Q4_1" else blocks[..., 2:]
    return np.concatenate([quants & 15, quants >> 4], axis=-1)


def _two_planes(q: np.ndarray, d: torch.Tensor, in_features: int) -> Nibbles:
    n = q.shape[0]
    high = ((q >> 4) + 8).astype(np.uint8).reshape(n, in_features)  # arithmetic shift: -8..7
    low = (q & 15).astype(np.uint8).reshape(n, in_features)
    codes = torch.from_numpy(np.concatenate([high, low], axis=1))
    scale = torch.cat([16 * d, d], dim=1)
    zero = torch.cat([torch.zeros_like(d), 8 * d], dim=1)
    return Nibbles(codes, scale, zero, in_features, 2)
