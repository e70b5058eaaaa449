"""Linear layers with their weights packed once for oneDNN, for float32 stages on CPU.

A plain ``F.linear`` with few rows (a decode batch) repacks its weight on every call;
packed once at load time the same products read each weight once. Measured on the
2-core development machine, one thread, weights cold in memory: a [16, 576] x [576,
3072] product 0.96 -> 0.61 ms, the LM head [16, 576] x [576, 49152] 17.3 -> 12.3 ms, and
at 45 rows 1.29 -> 1.09 ms and 22.0 -> 19.0 ms (docs/bench/targets.md). Where torch lacks oneDNN
the layers stay as they are.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn

# The row count the packing is tuned for (any count runs; this one is a decode batch's).
ROWS_HINT = 16


def packing_available() -> bool:
    ops = torch.ops.mkldnn
    return bool(torch.backends.mkldnn.is_available()) and all(
        hasattr(ops, name) for name in ("_reorder_linear_weight", "_linear_pointwise")
    )


class PackedLinear(nn.Module):
    """``linear`` with its weight in oneDNN's packed layout (a buffer, no longer a parameter)."""

    packed: torch.Tensor

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), ROWS_HINT))
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        return self.product()(flat).view(*x.shape[:-1], self.out_features)

    def product(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The product on [T, in_features] as a plain function of the layer's tensors (a
        stage's layers call it without the module: kvasir/model/decoder.py)."""
        return partial(_packed_product, packed=self.packed, bias=self.bias)


def _packed_product(x: torch.Tensor, *, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def pack_linears(module: nn.Module) -> int:
    """Replace every float32 linear layer under ``module`` by a packed one; how many."""
    if not packing_available():
        return 0
    count = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if (
                isinstance(child, nn.Linear)
                and child.weight.dtype == torch.float32
                and child.weight.device.type == "cpu"
            ):
                setattr(parent, name, PackedLinear(child))
                count += 1
    return count
