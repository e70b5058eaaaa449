"""A GGUF file's tensors by their Hugging Face names, as stored.

The names map through the ``gguf`` package's table for the file's architecture
(``model.layers.3.self_attn.q_proj.weight`` is ``blk.3.attn_q.weight``). llama.cpp's
converter reorders the rows of a Llama query and key matrix for its rotary layout;
transformers' GGUF loader, which wrote the float32 copy in the cache
(kvasir/model/convert.py), puts them back for files of architecture ``llama`` whose name
does not say Mistral, and so does this reader: one rule for both copies.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import torch

from kvasir.errors import ModelSourceError
from kvasir.model.quant.ggml import BLOCK, BLOCK_BYTES, FORMATS, Format, Nibbles, decode
from kvasir.model.quant.gguf_index import GgufFormatError, read_index


class GgufTensors:
    """The tensors of one GGUF file (memory-mapped: nothing is read until asked for)."""

    def __init__(self, path: Path, num_layers: int, heads: int, kv_heads: int) -> None:
        try:
            import gguf

            self._index = read_index(path)
            self.architecture = str(self._index.metadata.get("general.architecture", ""))
            arch = {name: key for key, name in gguf.MODEL_ARCH_NAMES.items()}.get(self.architecture)
            if arch is None:
                raise GgufFormatError(f"its architecture {self.architecture!r} has no GGUF tensor names")
            self._names = gguf.get_tensor_name_map(arch, num_layers)
        except ImportError:
            raise ModelSourceError("reading GGUF files needs the gguf package: run `pip install gguf`") from None
        except (OSError, GgufFormatError) as exc:
            raise ModelSourceError(f"{path} is not a readable GGUF file: {exc}") from None
        self.path = path
        self._tensors = self._index.tensors
        name = str(self._index.metadata.get("general.name", ""))
        self._rotary_rows = self.architecture == "llama" and "mistral" not in name.lower()
        self._heads = {"attn_q": heads, "attn_k": kv_heads}

    def stored_name(self, hf_name: str) -> str | None:
        name = self._names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        return name if name in self._tensors else None

    def format(self, hf_name: str) -> str | None:
        """The stored type's name (``Q4_1``, ``F32``, ...); None if the file has no such tensor."""
        name = self.stored_name(hf_name)
        return None if name is None else _type_name(self._tensors[name].type_id)

    def served(self, hf_name: str) -> Format | None:
        """The tensor's format if it is one served as stored (kvasir/model/quant/ggml.py)."""
        fmt = self.format(hf_name)
        return next((f for f in FORMATS if f == fmt), None)

    def formats(self) -> Counter[str]:
        """How many tensors the file stores in each type."""
        return Counter(_type_name(t.type_id) for t in self._tensors.values())

    def nibbles(self, hf_name: str) -> Nibbles:
        """A served matrix as Nibbles, its rows in transformers' order."""
        raw, fmt, width = self.blocks(hf_name)
        weights = decode(raw, fmt, width)
        name = self.stored_name(hf_name) or ""
        kind = name.split(".")[-2] if name.count(".") >= 2 else ""
        if self._rotary_rows and kind in self._heads:
            weights = weights.rows(_unrotated_rows(weights.out_features, self._heads[kind]))
        return weights

    def blocks(self, hf_name: str) -> tuple[np.ndarray, Format, int]:
        """A served matrix's stored bytes [rows, bytes per row], format and row length."""
        name = self.stored_name(hf_name)
        fmt = self.served(hf_name)
        if name is None or fmt is None:
            raise ModelSourceError(f"{self.path}: {hf_name} is not stored in a format served as stored")
        info = self._tensors[name]
        width, rows = int(info.shape[0]), int(np.prod(info.shape[1:], dtype=np.int64))
        if width % BLOCK:
            raise ModelSourceError(f"{self.path}: {name} has rows of {width} values, not whole blocks of {BLOCK}")
        row_bytes = width // BLOCK * BLOCK_BYTES[fmt]
        try:
            data = self._index.data(info, rows * row_bytes)
        except ValueError as exc:  # numpy: the mapping runs past the end of the file
            raise ModelSourceError(f"{self.path} is truncated: {name}: {exc}") from None
        return data.reshape(rows, row_bytes), fmt, width


def _type_name(type_id: int) -> str:
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(type_id).name
    except ValueError:
        return f"type {type_id}"


def _unrotated_rows(rows: int, heads: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's per-head interleaving of rotary halves."""
    half = rows // heads // 2
    return torch.arange(rows).view(heads, half, 2).transpose(1, 2).reshape(rows)
