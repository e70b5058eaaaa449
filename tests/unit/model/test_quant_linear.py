"""QuantLinear and QuantEmbedding: PyTorch's grouped int4 kernel on stored matrices,
against the float products of the same values."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from kvasir.model.fused import _fused_linear
from kvasir.model.quant.ggml import decode
from kvasir.model.quant.linear import QuantEmbedding, QuantLinear, int4_kernels_available, pack_quantized

pytestmark = pytest.mark.skipif(not int4_kernels_available(), reason="this torch has no int4 CPU kernels")


def matrix(rows: int, width: int, fmt: str, seed: int = 0) -> tuple[np.ndarray, torch.Tensor]:
    weights = np.random.default_rng(seed).standard_normal((rows, width)).astype(np.float32)
    raw = quants.quantize(weights, GGMLQuantizationType[fmt])
    return raw, torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType[fmt]))


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal up to float32 summation order."""
    return bool(torch.allclose(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max())))


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize(("rows", "width"), [(7, 96), (32, 64), (192, 576), (33, 1536)])
def test_products_equal_the_float_matrixs(fmt, rows, width):
    raw, reference = matrix(rows, width, fmt)
    bias = torch.randn(rows)
    layer = QuantLinear(decode(raw, fmt, width), bias.clone())
    layer.pack(torch.float32)
    x = torch.randn(2, 5, width)
    assert close(layer(x), x @ reference.T + bias)
    assert layer(x[0, :1]).shape == (1, rows)


def test_stacked_layers_compute_their_parts_side_by_side():
    parts = [QuantLinear(decode(matrix(n, 64, fmt, seed=n)[0], fmt, 64)) for n, fmt in ((32, "Q4_1"), (16, "Q8_0"))]
    x = torch.randn(3, 64)
    fused = _fused_linear(parts)
    assert isinstance(fused, QuantLinear) and fused.planes == 2
    wanted = torch.cat([x @ part.unpacked().dequantize().T for part in parts], dim=1)
    pack_quantized(fused, torch.float32)
    assert close(fused(x), wanted)


def test_a_stored_part_beside_a_float_one_is_dequantised_to_stack():
    stored = QuantLinear(decode(matrix(16, 64, "Q4_0")[0], "Q4_0", 64))
    plain = torch.nn.Linear(64, 8, bias=False)
    fused = _fused_linear([stored, plain])
    assert isinstance(fused, torch.nn.Linear)
    assert torch.equal(fused.weight[:16], stored.unpacked().dequantize())


def test_a_packed_layer_cannot_be_stacked_again():
    layer = QuantLinear(decode(matrix(16, 32, "Q4_1")[0], "Q4_1", 32))
    layer.pack(torch.float32)
    with pytest.raises(RuntimeError, match="packed"):
        QuantLinear.stacked([layer, layer])


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_1"])
def test_embedding_lookups_decode_only_the_rows_asked_for(fmt):
    raw, reference = matrix(40, 64, fmt)
    table = QuantEmbedding(raw, fmt, 64, torch.float32)
    ids = torch.tensor([[3, 39], [0, 3]])
    assert torch.equal(table(ids), reference[ids])
    assert table.stored_bytes == raw.nbytes
