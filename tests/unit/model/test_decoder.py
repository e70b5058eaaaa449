"""Kvasir's decoder-layer arithmetic against transformers' own, bit for bit.

The whole layer (and the whole model) is checked against transformers' ``generate`` in
tests/unit/stage/test_chain.py; here the two pieces Kvasir computes differently, the
rotary embedding and the RMS norm, must give exactly transformers' values in each dtype.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from kvasir.model.decoder import rms_norm, rope_tables, rotate

FAMILY_MODULES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def modeling(family: str):
    return importlib.import_module(f"transformers.models.{family}.modeling_{family}")


@pytest.mark.parametrize("family", FAMILY_MODULES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotation_equals_transformers(family, dtype):
    generator = torch.Generator().manual_seed(3)
    tokens, heads, kv_heads, dim = 7, 6, 2, 16
    query = torch.randn(tokens, heads, dim, generator=generator).to(dtype)
    key = torch.randn(tokens, kv_heads, dim, generator=generator).to(dtype)
    angles = torch.randn(1, tokens, dim // 2, generator=generator) * 40
    cos = torch.cat([angles, angles], dim=-1).cos().to(dtype)
    sin = torch.cat([angles, angles], dim=-1).sin().to(dtype)
    # transformers' layout: [1, heads, T, dim], tables [1, T, dim]
    want_q, want_k = modeling(family).apply_rotary_pos_emb(
        query.transpose(0, 1)[None], key.transpose(0, 1)[None], cos, sin
    )
    rope = rope_tables(cos, sin)
    got = rotate(torch.cat([query, key], dim=1), rope)
    assert torch.equal(got[:, :heads], want_q[0].transpose(0, 1))
    assert torch.equal(got[:, heads:], want_k[0].transpose(0, 1))


@pytest.mark.parametrize("family", FAMILY_MODULES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 576), (13, 64), (5, 3, 16)])
def test_rms_norm_equals_transformers(family, dtype, shape):
    generator = torch.Generator().manual_seed(5)
    module = modeling(family)
    norm_type = next(getattr(module, name) for name in dir(module) if name.endswith("RMSNorm"))
    norm = norm_type(shape[-1], eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(shape[-1], generator=generator) + 0.5)
    x = (torch.randn(*shape, generator=generator) * 3).to(dtype)
    with torch.inference_mode():
        assert torch.equal(rms_norm(norm, x), norm(x))
