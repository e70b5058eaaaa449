"""GGML block formats decoded into Nibbles, against the gguf package's own dequantiser."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from kvasir.model.quant.ggml import FORMATS, Nibbles, cat_rows, decode, dequantize_rows


def stored(rows: int, width: int, fmt: str, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A random matrix quantised to ``fmt``: its bytes and the gguf package's dequantisation."""
    weights = np.random.default_rng(seed).standard_normal((rows, width)).astype(np.float32)
    qtype = GGMLQuantizationType[fmt]
    raw = quants.quantize(weights, qtype)
    return raw, quants.dequantize(raw, qtype)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("rows", "width"), [(3, 32), (48, 96), (17, 576)])
def test_every_format_decodes_to_the_gguf_packages_values_exactly(fmt, rows, width):
    raw, reference = stored(rows, width, fmt)
    weights = decode(raw, fmt, width)
    assert weights.planes == (2 if fmt == "Q8_0" else 1)
    assert weights.codes.dtype == torch.uint8 and int(weights.codes.max()) <= 15
    assert tuple(weights.codes.shape) == (rows, weights.planes * width)
    assert torch.equal(weights.dequantize(), torch.from_numpy(reference))


@pytest.mark.parametrize("fmt", FORMATS)
def test_rows_dequantised_straight_from_the_blocks_equal_the_decoded_ones(fmt):
    raw, reference = stored(9, 96, fmt, seed=4)
    picked = [7, 0, 7, 3]
    got = dequantize_rows(raw[picked], fmt, 96)
    assert got.dtype == np.float32 and np.array_equal(got, reference[picked])
    assert torch.equal(torch.from_numpy(got), decode(raw, fmt, 96).dequantize()[picked])


def test_q8_0_extremes_split_into_two_nibbles_exactly():
    # -128 and 127 are the ends of a signed byte: 16 * hi + lo must reach both
    block = np.zeros((1, 34), dtype=np.uint8)
    block[0, :2] = np.frombuffer(np.float16(0.5).tobytes(), dtype=np.uint8)
    block[0, 2:] = np.array([-128, 127, -1, 0, 1] + [0] * 27, dtype=np.int8).view(np.uint8)
    values = decode(block, "Q8_0", 32).dequantize()[0, :5]
    assert values.tolist() == [-64.0, 63.5, -0.5, 0.0, 0.5]


def test_rows_reorder_and_stacking_keep_every_value():
    raw4, ref4 = stored(16, 64, "Q4_1", seed=1)
    raw8, ref8 = stored(8, 64, "Q8_0", seed=2)
    q4, q8 = decode(raw4, "Q4_1", 64), decode(raw8, "Q8_0", 64)
    order = torch.randperm(16)
    assert torch.equal(q4.rows(order).dequantize(), torch.from_numpy(ref4)[order])
    both = cat_rows([q4, q8])  # one plane widened to two: the added plane is all zero
    assert both.planes == 2 and both.out_features == 24
    assert torch.equal(both.dequantize(), torch.from_numpy(np.concatenate([ref4, ref8])))
    # two codes a byte; a scale and a zero per group of 32 per plane, in the activations' dtype
    assert both.held_bytes(torch.bfloat16) == 24 * 128 // 2 + 2 * 2 * 24 * 4


def test_malformed_blocks_are_refused():
    raw, _ = stored(4, 64, "Q4_0")
    with pytest.raises(ValueError, match="does not hold rows of 96 values"):
        decode(raw, "Q4_0", 96)
    with pytest.raises(ValueError, match="not whole blocks of 32"):
        decode(raw, "Q4_0", 48)
    with pytest.raises(ValueError, match="widths"):
        cat_rows([decode(raw, "Q4_0", 64), decode(stored(4, 32, "Q4_0")[0], "Q4_0", 32)])
    with pytest.raises(ValueError, match="cannot become"):
        decode(stored(4, 32, "Q8_0")[0], "Q8_0", 32).as_planes(1)


def test_nibbles_state_their_own_shape():
    weights = Nibbles(torch.full((2, 32), 8, dtype=torch.uint8), torch.ones(2, 1), torch.zeros(2, 1), 32, 1)
    assert weights.out_features == 2 and torch.equal(weights.dequantize(), torch.zeros(2, 32))
