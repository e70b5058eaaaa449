"""4-bit matrices as quantized checkpoints store them, decoded into Nibbles.

Three weight-only formats of Hugging Face checkpoints (named by the config's
``quantization_config``) hold a linear layer's matrix as 4-bit integers packed eight to an
int32 word, with a float scale (and an integer zero) per group of ``group_size`` inputs:

- **compressed-tensors** ``pack-quantized`` (llm-compressor's W4A16): ``weight_packed``
  int32 ``[N, K / 8]``, input ``k`` in bits ``4 (k % 8)`` of word ``k // 8``, stored as
  ``q + 8`` (``q`` in [-8, 7]); ``weight_scale`` ``[N, K / G]``; asymmetric schemes add
  ``weight_zero_point`` packed the same way along the output axis (``[N / 8, K / G]``).
  ``w = (q - zero) scale``. With activation order by group, ``weight_g_idx`` says each
  input's group (served only when that is input order).
- **GPTQ**: ``qweight`` int32 ``[K / 8, N]`` packed along the input axis, ``qzeros`` int32
  ``[K / G, N / 8]`` along the output axis, ``scales`` ``[K / G, N]``, ``g_idx`` ``[K]``;
  ``w = (q - zero) scale`` with the stored zero one less than the real one in the
  original format (``checkpoint_format = "gptq"``), not in ``gptq_v2``.
- **AWQ** (``version = "gemm"``): ``qweight`` int32 ``[K, N / 8]`` and ``qzeros``
  ``[K / G, N / 8]`` packed along the output axis in AWQ's order (word nibble ``i`` holds
  output ``8 c + [0, 2, 4, 6, 1, 3, 5, 7][i]``), ``scales`` ``[K / G, N]``;
  ``w = (q - zero) scale``.

Each becomes Nibbles (kvasir/model/quant/ggml.py): the codes as they are, the scale
repeated over each group's 32-value blocks, and ``zero = (8 - z) scale`` for a code
``c = q`` read as unsigned, so ``(c - 8) scale + zero`` is ``(q - z) scale``: exact in
float32 (a small integer times a 16-bit float). A group must be whole blocks of 32
inputs; GPTQ's activation order (``g_idx`` not ascending by groups) is refused.
"""

from __future__ import annotations

import sys

import torch

from kvasir.errors import ModelSourceError
from kvasir.model.quant.ggml import BLOCK, Nibbles

WORD_VALUES = 8  # 4-bit values per int32 word
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # output of each nibble of a word, within its eight


def unpack_words(words: torch.Tensor) -> torch.Tensor:
    """int32 ``[R, C]`` to uint8 ``[R, 8 C]``: value ``i`` of a word from its bits ``4 i``."""
    if words.dtype != torch.int32 or words.dim() != 2:
        raise ModelSourceError(f"packed 4-bit values must be a 2-D int32 tensor, not {words.dtype} {list(words.shape)}")
    if sys.byteorder != "little":
        raise ModelSourceError("packed 4-bit checkpoints are read on little-endian machines only")
    octets = words.contiguous().view(torch.uint8)  # four bytes a word, lowest first
    return torch.stack([octets & 15, octets >> 4], dim=-1).reshape(words.shape[0], -1)


def regroup(terms: torch.Tensor, group: int, in_features: int) -> torch.Tensor:
    """Per-group terms ``[N, K / group]`` as float32 per 32-value block ``[N, K / 32]``."""
    if group % BLOCK or in_features % group:
        raise ModelSourceError(
            f"groups of {group} inputs over {in_features} inputs: served as stored only in whole "
            f"blocks of {BLOCK} (and whole groups)"
        )
    if terms.shape[1] != in_features // group:
        raise ModelSourceError(f"{terms.shape[1]} groups of scales for {in_features} inputs in groups of {group}")
    return terms.float().repeat_interleave(group // BLOCK, dim=1)


def _nibbles(codes: torch.Tensor, scale: torch.Tensor, zero_int: torch.Tensor, group: int) -> Nibbles:
    """``codes`` ``[N, K]`` (0..15), ``scale`` and integer zeros ``z`` ``[N, K / group]``
    (as unsigned codes: ``w = (c - z) scale``) as Nibbles."""
    in_features = codes.shape[1]
    if scale.shape[0] != codes.shape[0] or zero_int.shape != scale.shape:
        raise ModelSourceError(
            f"{codes.shape[0]} rows of codes, scales of shape {list(scale.shape)}, zeros of shape {list(zero_int.shape)}"
        )
    scale32 = regroup(scale, group, in_features)
    zero = regroup((8 - zero_int.float()) * scale.float(), group, in_features)
    return Nibbles(codes.to(torch.uint8).contiguous(), scale32, zero, in_features, 1)


def compressed_tensors(
    packed: torch.Tensor, scale: torch.Tensor, shape: tuple[int, int], group: int, zero_point: torch.Tensor | None
) -> Nibbles:
    """A ``pack-quantized`` matrix of ``shape`` [N, K]; ``group``: inputs per scale (K for
    one scale per output channel)."""
    rows, columns = shape
    codes = unpack_words(packed)[:, :columns]
    if codes.shape[0] != rows:
        raise ModelSourceError(f"weight_packed holds {codes.shape[0]} rows, weight_shape says {rows}")
    if zero_point is None:
        zero = torch.full_like(scale, 8, dtype=torch.float32)  # symmetric: q = c - 8
    else:
        zero = unpack_words(zero_point.t()).t()[:rows].float()  # stored as zero + 8, like the codes
    return _nibbles(codes, scale, zero, group)


def gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group: int, *, v2: bool) -> Nibbles:
    """A GPTQ matrix (groups in input order: no activation order)."""
    codes = unpack_words(qweight.t())  # [N, K]
    zeros = unpack_words(qzeros)[:, : codes.shape[0]].float() + (0 if v2 else 1)  # [K / G, N]
    return _nibbles(codes, scales.t(), zeros.t(), group)


def awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group: int) -> Nibbles:
    """An AWQ ``gemm`` matrix."""
    codes = _awq_columns(unpack_words(qweight)).t()  # [N, K]
    zeros = _awq_columns(unpack_words(qzeros)).float().t()  # [N, K / G]
    return _nibbles(codes, scales.t(), zeros, group)


def _awq_columns(values: torch.Tensor) -> torch.Tensor:
    """Unpacked AWQ words ``[R, 8 C]`` with each word's eight values in output order."""
    rows = values.shape[0]
    inverse = [AWQ_ORDER.index(column) for column in range(WORD_VALUES)]
    return values.view(rows, -1, WORD_VALUES)[:, :, inverse].reshape(rows, -1)


def check_group_order(g_idx: torch.Tensor, group: int) -> None:
    """A ``g_idx`` (GPTQ's, compressed-tensors' ``weight_g_idx``) must put input ``k`` in
    group ``k // group``: groups out of input order (activation order) are not served."""
    expected = torch.arange(g_idx.numel()) // group
    if not torch.equal(g_idx.long(), expected):
        raise ModelSourceError("groups in activation order (a g_idx not in input order) are not served as stored")
