"""A stage's slice of a prefix block as the pool stores it (kvasir/kvpool/slices.py): read
back exactly, and never into a place it was not made for, nor when its bytes changed."""

from __future__ import annotations

import msgspec
import pytest
import torch

from kvasir.kvpool.slices import SliceError, SliceMeta, decode_slice, encode_slice, slice_bytes
from tests.support.kvpool import SECRET

META = SliceMeta(
    model="0123456789abcdef/float32",
    layers=(3, 6),
    block_size=4,
    kv_heads=2,
    head_dim=8,
    dtype="float32",
    key=b"k" * 16,
)


def tensors(meta: SliceMeta = META, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[meta.dtype]
    return (
        torch.randn(meta.shape, generator=generator).to(dtype),
        torch.randn(meta.shape, generator=generator).to(dtype),
    )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_a_slice_reads_back_bit_for_bit(dtype):
    meta = msgspec.structs.replace(META, dtype=dtype)
    keys, values = tensors(meta)
    read_keys, read_values = decode_slice(encode_slice(meta, keys, values, SECRET), meta, SECRET)
    assert torch.equal(read_keys, keys) and torch.equal(read_values, values)
    assert len(encode_slice(meta, keys, values, SECRET)) > meta.payload_bytes


@pytest.mark.parametrize(
    "change",
    [
        {"model": "fedcba9876543210/float32"},
        {"layers": (0, 3)},
        {"block_size": 8},
        {"key": b"j" * 16},
        {"dtype": "bfloat16"},
    ],
    ids=lambda change: next(iter(change)),
)
def test_a_slice_made_with_anything_else_is_a_mismatch(change):
    stored = encode_slice(META, *tensors(), SECRET)
    with pytest.raises(SliceError, match=f"mismatch: made with another {next(iter(change))}") as refused:
        decode_slice(stored, msgspec.structs.replace(META, **change), SECRET)
    assert refused.value.kind == "mismatch"


def test_any_changed_or_missing_byte_is_corrupt():
    stored = encode_slice(META, *tensors(), SECRET)
    for at in (0, 10, 40, len(stored) // 2, len(stored) - 1):
        flipped = bytearray(stored)
        flipped[at] ^= 0x01
        with pytest.raises(SliceError) as refused:
            decode_slice(bytes(flipped), META, SECRET)
        assert refused.value.kind == "corrupt"
    for cut in (stored[:-1], stored[:20], b"", b"not a slice at all" * 4):
        with pytest.raises(SliceError, match="corrupt"):
            decode_slice(cut, META, SECRET)


def test_tensors_of_another_shape_are_not_stored():
    keys, values = tensors()
    with pytest.raises(ValueError, match="is not"):
        encode_slice(META, keys[:, :2], values[:, :2], SECRET)


def test_the_size_is_checked_before_anything_is_hashed():
    stored = encode_slice(META, *tensors(), SECRET)
    assert len(stored) == slice_bytes(META)
    with pytest.raises(SliceError, match=f"corrupt: {len(stored) + 1} bytes, not {len(stored)}"):
        decode_slice(stored + b"x", META, SECRET)
    with pytest.raises(SliceError, match="corrupt: the checksum does not match"):
        decode_slice(stored, META, b"another secret")  # written by a hand without this fleet's secret
