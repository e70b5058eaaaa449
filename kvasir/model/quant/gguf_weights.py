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
from typing import Any

import numpy as np
import torch

from kvasir.errors import ModelSourceError
from kvasir.model.quant.ggml import FORMATS, Format, Nibbles, decode


class GgufTensors:
    """The tensors of one GGUF file (memory-mapped: nothing is read until asked for)."""

    def __init__(self, path: Path, num_layers: int, heads: int, kv_heads: int) -> None:
        try:
            import gguf

            reader = gguf.GGUFReader(str(path))
            self.architecture = _text(reader, "general.architecture")
            arch = {name: key for key, name in gguf.MODEL_ARCH_NAMES.items()}[self.architecture]
            self._names = gguf.get_tensor_name_map(arch, num_layers)
        except ImportError:
            raise ModelSourceError("reading GGUF files needs the gguf package: run `pip install gguf`") from None
        except Exception as exc:  # the gguf reader raises a variety of errors on bad files
            raise ModelSourceError(f"{path} is not a readable GGUF file: {exc}") from None
        self.path = path
        self._tensors: dict[str, Any] = {t.name: t for t in reader.tensors}
        name = _text(reader, "general.name") if "general.name" in reader.fields else ""
        self._rotary_rows = self.architecture == "llama" and "mistral" not in name.lower()
        self._heads = {"attn_q": heads, "attn_k": kv_heads}

    def gguf_name(self, hf_name: str) -> str | None:
        name = self._names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        return name if name in self._tensors else None

    def format(self, hf_name: str) -> str | None:
        """The stored type's name (``Q4_1``, ``F32``, ...); None if the file has no such tensor."""
        name = self.gguf_name(hf_name)
        return None if name is None else self._tensors[name].tensor_type.name

    def served(self, hf_name: str) -> Format | None:
        """The tensor's format if it is one served as stored (kvasir/model/quant/ggml.py)."""
        fmt = self.format(hf_name)
        return next((f for f in FORMATS if f == fmt), None)

    def formats(self) -> Counter[str]:
        """How many tensors the file stores in each type."""
        return Counter(t.tensor_type.name for t in self._tensors.values())

    def nibbles(self, hf_name: str) -> Nibbles:
        """A served matrix as Nibbles, its rows in transformers' order."""
        raw, fmt, width = self.blocks(hf_name)
        weights = decode(raw, fmt, width)
        name = self.gguf_name(hf_name) or ""
        kind = name.split(".")[-2] if name.count(".") >= 2 else ""
        if self._rotary_rows and kind in self._heads:
            weights = weights.rows(_unrotated_rows(weights.out_features, self._heads[kind]))
        return weights

    def blocks(self, hf_name: str) -> tuple[np.ndarray, Format, int]:
        """A served matrix's stored bytes [rows, bytes per row], format and row length."""
        name = self.gguf_name(hf_name)
        fmt = self.served(hf_name)
        if name is None or fmt is None:
            raise ModelSourceError(f"{self.path}: {hf_name} is not stored in a format served as stored")
        tensor = self._tensors[name]
        return np.asarray(tensor.data), fmt, int(tensor.shape[0])


def _text(reader: Any, key: str) -> str:
    field = reader.fields[key]
    return bytes(field.parts[field.data[0]]).decode()


def _unrotated_rows(rows: int, heads: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's per-head interleaving of rotary halves."""
    half = rows // heads // 2
    return torch.arange(rows).view(heads, half, 2).transpose(1, 2).reshape(rows)
