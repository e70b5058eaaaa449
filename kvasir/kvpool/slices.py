"""One stage's slice of one prefix block, as the pool stores it: a header naming what it
was made with (the model, dtype, layer range, block size and the block's prefix key) and
the keys and values of its tokens, under a checksum keyed with the fleet's pool secret.

A slice is read back only into the same place it came from: a header that differs from
what the reader expects (another model, dtype, layer range, block size or key) is a
``SliceError("mismatch")``, and bytes that do not check out (a torn or corrupt file, one
written by a hand without the secret, or before the checksum was keyed) a
``SliceError("corrupt")``; the caller counts it and recomputes the block, never serving
it. The size is checked before anything is hashed: a slice made as expected has exactly
``slice_bytes(expected)``.
Layout: ``MAGIC``, the header's length (4 bytes, little-endian), the header (msgpack),
the keys then the values (raw, C order), then a 32-byte blake2b of everything before it,
keyed with the secret (kvasir/config/keys.py ``POOL_SECRET``).
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Literal

import msgspec
import torch

from kvasir.wire.decoding import Malformed, decode

MAGIC = b"KVSLICE2"  # 1: the checksum was not keyed
CHECKSUM_BYTES = 32
MAX_HEADER = 4096
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class SliceError(ValueError):
    def __init__(self, kind: Literal["mismatch", "corrupt"], detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind


class SliceMeta(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a slice was made with: it is used only where every field is the same."""

    model: str  # kvasir/model/fingerprint.py model_identity: the weights and the dtype they serve in
    layers: tuple[int, int]  # the stage's layers [first, end)
    block_size: int
    kv_heads: int
    head_dim: int
    dtype: str
    key: bytes  # the block's prefix key (kvasir/sched/prefix.py: its namespace and every token up to its end)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The keys' (and the values') shape: [layers, block_size, kv_heads, head_dim]."""
        return (self.layers[1] - self.layers[0], self.block_size, self.kv_heads, self.head_dim)

    @property
    def payload_bytes(self) -> int:
        first, end = self.layers
        return 2 * (end - first) * self.block_size * self.kv_heads * self.head_dim * DTYPES[self.dtype].itemsize


def slice_bytes(meta: SliceMeta) -> int:
    """The stored size of every slice made as ``meta`` says."""
    return len(MAGIC) + 4 + len(msgspec.msgpack.encode(meta)) + meta.payload_bytes + CHECKSUM_BYTES


def encode_slice(meta: SliceMeta, keys: torch.Tensor, values: torch.Tensor, secret: bytes) -> bytes:
    """The stored form of one slice (``keys`` and ``values`` of ``meta.shape``, on the CPU)."""
    for name, tensor in (("keys", keys), ("values", values)):
        if tuple(tensor.shape) != meta.shape or tensor.dtype != DTYPES[meta.dtype]:
            raise ValueError(f"{name} of shape {tuple(tensor.shape)} {tensor.dtype} is not {meta.shape} {meta.dtype}")
    header = msgspec.msgpack.encode(meta)
    body = b"".join((MAGIC, len(header).to_bytes(4, "little"), header, _raw(keys), _raw(values)))
    return body + _checksum(body, secret)


def decode_slice(data: bytes, expected: SliceMeta, secret: bytes) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values of a stored slice made as ``expected`` says (SliceError otherwise)."""
    view = memoryview(data)
    if len(view) < len(MAGIC) + 4 + CHECKSUM_BYTES or bytes(view[: len(MAGIC)]) != MAGIC:
        raise SliceError("corrupt", "not a stored KV slice")
    if len(view) != (size := slice_bytes(expected)):  # nothing hashed: at most its header is read, to say why
        meta, _ = _header(view[:-CHECKSUM_BYTES])
        if meta != expected:
            raise SliceError("mismatch", _difference(meta, expected))
        raise SliceError("corrupt", f"{len(view)} bytes, not {size}")
    body, checksum = view[:-CHECKSUM_BYTES], bytes(view[-CHECKSUM_BYTES:])
    if not hmac.compare_digest(_checksum(body, secret), checksum):
        raise SliceError("corrupt", "the checksum does not match (damaged, or not written with this fleet's secret)")
    meta, end = _header(body)
    if meta != expected:
        raise SliceError("mismatch", _difference(meta, expected))
    payload = body[end:]
    if len(payload) != expected.payload_bytes:
        raise SliceError("corrupt", f"{len(payload)} bytes of keys and values, not {expected.payload_bytes}")
    half = len(payload) // 2
    return _tensor(payload[:half], expected), _tensor(payload[half:], expected)


def _checksum(body: bytes | memoryview, secret: bytes) -> bytes:
    return hashlib.blake2b(body, digest_size=CHECKSUM_BYTES, key=secret).digest()


def _header(body: memoryview) -> tuple[SliceMeta, int]:
    """The header of a slice's bytes (before the checksum) and where it ends;
    SliceError("corrupt") if it does not read."""
    start = len(MAGIC) + 4
    size = int.from_bytes(body[len(MAGIC) : start], "little")
    if size > MAX_HEADER or start + size > len(body):
        raise SliceError("corrupt", f"a header of {size} bytes")
    try:
        return decode(bytes(body[start : start + size]), SliceMeta), start + size
    except Malformed as exc:
        raise SliceError("corrupt", f"the header does not read: {exc}") from None


def _raw(tensor: torch.Tensor) -> bytes:
    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes()


def _tensor(raw: memoryview, meta: SliceMeta) -> torch.Tensor:
    data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return data.view(DTYPES[meta.dtype]).reshape(meta.shape)


def _difference(found: SliceMeta, expected: SliceMeta) -> str:
    fields = [f for f in SliceMeta.__struct_fields__ if getattr(found, f) != getattr(expected, f)]
    return "made with another " + ", ".join(fields)
