"""A quantized model folder's packed matrices, by the Hugging Face names of the float
weights they stand for (``model.layers.0.mlp.down_proj.weight`` is stored as
``...down_proj.weight_packed`` with its scales, or ``...down_proj.qweight`` with its
zeros and scales), decoded into Nibbles (kvasir/model/quant/checkpoint_formats.py).
Matrices the checkpoint keeps in float (an ignored LM head) are read as before."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from kvasir.errors import ModelSourceError
from kvasir.model.quant import checkpoint_formats as formats
from kvasir.model.quant.ggml import Format, Nibbles
from kvasir.model.quant.schemes import Scheme

PACKED = {"compressed-tensors": "weight_packed", "gptq": "qweight", "awq": "qweight"}


class CheckpointTensors:
    """``index``: the folder's tensor -> safetensors file map."""

    def __init__(self, folder: Path, index: dict[str, str], scheme: Scheme) -> None:
        self.folder = folder
        self.scheme = scheme
        self.label = scheme.describe()
        self._index = index

    def stored_name(self, hf_name: str) -> str | None:
        """The packed tensor standing for ``hf_name``; None when it is not packed."""
        name = f"{hf_name.removesuffix('.weight')}.{PACKED[self.scheme.method]}"
        return name if hf_name.endswith(".weight") and name in self._index else None

    def format(self, hf_name: str) -> str | None:
        if self.stored_name(hf_name) is not None:
            return self.label
        return "float" if hf_name in self._index else None

    def served(self, hf_name: str) -> str | None:
        return self.label if self.stored_name(hf_name) is not None else None

    def formats(self) -> Counter[str]:
        """How many matrices the folder stores packed."""
        suffix = f".{PACKED[self.scheme.method]}"
        return Counter({self.label: sum(1 for name in self._index if name.endswith(suffix))})

    def blocks(self, hf_name: str) -> tuple[np.ndarray, Format, int]:
        raise ModelSourceError(f"{self.folder}: {hf_name}: a quantized checkpoint stores no embedding table packed")

    def nibbles(self, hf_name: str) -> Nibbles:
        prefix = hf_name.removesuffix(".weight")
        try:
            return self._decode(prefix)
        except (KeyError, RuntimeError, ValueError) as exc:  # a tensor missing, or of the wrong shape
            raise ModelSourceError(f"{self.folder}: {prefix} is not a readable {self.label} matrix: {exc}") from None

    def _tensor(self, name: str) -> torch.Tensor:
        with safe_open(str(self.folder / self._index[name]), framework="pt", device="cpu") as handle:
            return handle.get_tensor(name)

    def _decode(self, prefix: str) -> Nibbles:
        scheme, read = self.scheme, self._tensor
        if scheme.method == "compressed-tensors":
            rows, columns = (int(n) for n in read(f"{prefix}.weight_shape").tolist())
            zero = None if scheme.symmetric else read(f"{prefix}.weight_zero_point")
            scale, group = read(f"{prefix}.weight_scale"), scheme.group or columns
            if f"{prefix}.weight_g_idx" in self._index:  # activation order: served if the groups are in order
                formats.check_group_order(read(f"{prefix}.weight_g_idx"), group)
            return formats.compressed_tensors(read(f"{prefix}.weight_packed"), scale, (rows, columns), group, zero)
        qweight, qzeros, scales = read(f"{prefix}.qweight"), read(f"{prefix}.qzeros"), read(f"{prefix}.scales")
        if scheme.method == "gptq":
            columns = qweight.shape[0] * formats.WORD_VALUES
            group = scheme.group or columns
            if f"{prefix}.g_idx" in self._index:
                formats.check_group_order(read(f"{prefix}.g_idx"), group)
            return formats.gptq(qweight, qzeros, scales, group, v2=scheme.v2)
        return formats.awq(qweight, qzeros, scales, scheme.group or qweight.shape[0])
