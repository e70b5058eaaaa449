"""Quantized checkpoints' 4-bit matrices decode to Nibbles whose values are the formats' own.

Each test packs random integers the way the format's writer lays them out (written here
from the formats' descriptions, word by word), then checks the Nibbles' dequantised matrix
against ``(q - zero) * scale`` computed directly.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvasir.errors import ModelSourceError
from kvasir.model.quant.checkpoint_formats import (
    AWQ_ORDER,
    awq,
    check_group_order,
    compressed_tensors,
    gptq,
    unpack_words,
)
from tests.support.quantized import dequantized, pack_words

N, K = 48, 256


def draw(group: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    q = rng.integers(0, 16, size=(N, K))
    zeros = rng.integers(0, 16, size=(N, K // group))
    scales = torch.from_numpy(rng.uniform(0.001, 0.05, size=(N, K // group))).half()
    return q, zeros, scales


def test_words_unpack_lowest_bits_first():
    word = torch.tensor([[0x76543210, 0x0FEDCBA9]], dtype=torch.int32)
    assert unpack_words(word).tolist() == [[0, 1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 12, 13, 14, 15, 0]]


@pytest.mark.parametrize("group", [32, 128, K])
@pytest.mark.parametrize("symmetric", [True, False])
def test_compressed_tensors_pack_quantized(group, symmetric):
    q, zeros, scales = draw(group)
    if symmetric:
        zeros[:] = 8
    packed = pack_words(q)  # stored codes are q + 8 for q in [-8, 7]: the unsigned values themselves
    zero_point = None if symmetric else pack_words(zeros.T).t().contiguous()  # packed along the outputs
    nibbles = compressed_tensors(packed, scales, (N, K), group, zero_point)
    assert torch.equal(nibbles.dequantize(), dequantized(q, zeros, scales, group))


@pytest.mark.parametrize("v2", [False, True])
def test_gptq(v2):
    group = 64
    q, zeros, scales = draw(group, seed=1)
    stored = np.clip(zeros - (0 if v2 else 1), 0, 15)  # the original format keeps each zero minus one
    real = stored + (0 if v2 else 1)
    qweight = pack_words(q).t().contiguous()  # [K / 8, N]: packed along the inputs
    qzeros = pack_words(stored.T.copy())  # [K / G, N / 8]
    nibbles = gptq(qweight, qzeros, scales.t().contiguous(), group, v2=v2)
    assert torch.equal(nibbles.dequantize(), dequantized(q, real, scales, group))


def test_awq_gemm_order():
    group = 128
    q, zeros, scales = draw(group, seed=2)
    qweight = pack_words(q.T.copy(), AWQ_ORDER)  # [K, N / 8], outputs packed in AWQ's order
    qzeros = pack_words(zeros.T.copy(), AWQ_ORDER)  # [K / G, N / 8]
    nibbles = awq(qweight, qzeros, scales.t().contiguous(), group)
    assert torch.equal(nibbles.dequantize(), dequantized(q, zeros, scales, group))


def test_groups_that_are_not_whole_blocks_and_activation_order_are_refused():
    q, zeros, scales = draw(32)
    with pytest.raises(ModelSourceError, match="whole blocks of 32"):
        compressed_tensors(pack_words(q), torch.ones(N, K // 16).half(), (N, K), 16, None)
    check_group_order(torch.arange(K) // 128, 128)
    with pytest.raises(ModelSourceError, match="activation order"):
        check_group_order(torch.randperm(K, generator=torch.Generator().manual_seed(0)) // 128, 128)
