"""Kvasir's decoder-layer arithmetic against transformers' own, bit for bit.

The whole layer (and the whole model) is checked against transformers' ``generate`` in
tests/unit/stage/test_chain.py; here the pieces Kvasir computes differently, the rotary
embedding (applied, and its tables looked up) and the RMS norm, must give exactly
transformers' values in each dtype.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from kvasir.model.decoder import RotaryTables, rms_norm, rope_tables, rotate

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


ROPE_PARAMETERS = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
}


@pytest.mark.parametrize("family", ("llama", "mistral", "qwen2", "qwen3"))
@pytest.mark.parametrize("kind", ROPE_PARAMETERS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_rows_looked_up_equal_the_modules_own(family, kind, dtype):
    module = modeling(family)
    config_type = next(getattr(module, name) for name in dir(module) if name.endswith("Config"))
    rotary_type = next(getattr(module, name) for name in dir(module) if name.endswith("RotaryEmbedding"))
    config = config_type(
        hidden_size=64, num_attention_heads=4, max_position_embeddings=512, rope_parameters=ROPE_PARAMETERS[kind]
    )
    tables = RotaryTables(rotary_type(config=config), dtype, torch.device("cpu"), 256)
    assert (tables.tables is None) == (kind == "dynamic")  # its frequencies follow the batch's longest position
    hidden = torch.zeros(5, 64, dtype=dtype)
    for positions in ([0, 1, 2, 3, 4], [250, 7, 100, 255, 31], [300, 2, 3, 4, 5]):  # the last past the tables
        at = torch.tensor(positions)
        got = tables(hidden, at, max(positions) + 1)
        want = rope_tables(*rotary_type(config=config)(hidden, at[None]))
        assert torch.equal(got.cos, want.cos) and torch.equal(got.sin, want.sin), positions
