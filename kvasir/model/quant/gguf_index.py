"""A GGUF file's header and tensor table, read directly (the gguf package's reader builds
a view of every metadata value, 3.4 s for the default model's 49,152-token vocabulary;
this walks past them in milliseconds). Tensor data is memory-mapped, never read here.

Layout (GGUF v2/v3, little-endian): magic ``GGUF``, version u32, tensor count u64,
metadata count u64; each metadata entry a string key, a u32 type and its value (strings
are a u64 length and bytes; arrays a u32 element type, a u64 count and the elements); then
per tensor its name, u32 dimension count, u64 dimensions (innermost first), u32 GGML type
and u64 offset into the data, which starts at the next multiple of ``general.alignment``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9
MAX_ITEMS = 1 << 31  # more tensors, entries or array elements than any real file holds
MAX_DEPTH = 4  # arrays inside arrays: real files hold arrays of scalars or strings (depth 1)
MAX_STRING = 1 << 26  # bytes in one string (a chat template or a token is far shorter)


class GgufFormatError(ValueError):
    """The file is not a GGUF file this reader understands (the message says where)."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type_id: int  # GGML's type number (gguf.GGMLQuantizationType)
    shape: tuple[int, ...]  # innermost first, as GGUF stores it
    offset: int  # from the start of the file


@dataclass(frozen=True)
class GgufIndex:
    path: Path
    metadata: dict[str, object]  # scalar and string values only (arrays are skipped)
    tensors: dict[str, TensorInfo]

    def data(self, info: TensorInfo, nbytes: int) -> np.ndarray:
        """``nbytes`` of a tensor's data, memory-mapped (uint8)."""
        return np.memmap(self.path, dtype=np.uint8, mode="r", offset=info.offset, shape=(nbytes,))


class _Cursor:
    def __init__(self, raw: bytes | memoryview) -> None:
        self.raw, self.at = raw, 0

    def take(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.at + size > len(self.raw):
            raise GgufFormatError(f"the file ends inside its header (at byte {self.at})")
        (value,) = struct.unpack_from(fmt, self.raw, self.at)
        self.at += size
        return value

    def count(self, what: str) -> int:
        n = self.take("<Q")
        if n > MAX_ITEMS:
            raise GgufFormatError(f"{what} count {n} is not plausible")
        return n

    def string(self) -> str:
        n = self.count("string length")
        if n > MAX_STRING:
            raise GgufFormatError(f"a string of {n} bytes at byte {self.at} (at most {MAX_STRING})")
        if self.at + n > len(self.raw):
            raise GgufFormatError(f"a string runs past the end of the file (at byte {self.at})")
        text = bytes(self.raw[self.at : self.at + n]).decode("utf-8", errors="replace")
        self.at += n
        return text

    def value(self, kind: int, depth: int = 0) -> object:
        if kind in SCALARS:
            return self.take(SCALARS[kind])
        if kind == STRING:
            return self.string()
        if kind != ARRAY:
            raise GgufFormatError(f"unknown metadata value type {kind}")
        if depth == MAX_DEPTH:
            raise GgufFormatError(f"metadata arrays nested deeper than {MAX_DEPTH} (at byte {self.at})")
        inner, n = self.take("<I"), self.count("array")
        if inner in SCALARS:  # skipped whole
            self.at += n * struct.calcsize(SCALARS[inner])
            if self.at > len(self.raw):
                raise GgufFormatError(f"an array of {n} values runs past the end of the file")
        else:
            for _ in range(n):
                self.value(inner, depth + 1)
        return None


def read_index(path: Path) -> GgufIndex:
    """The header and tensor table of ``path``; GgufFormatError if it is not GGUF."""
    try:
        raw = np.memmap(path, dtype=np.uint8, mode="r")
    except ValueError as exc:  # numpy cannot map an empty file
        raise GgufFormatError(str(exc)) from None
    cursor = _Cursor(raw.data)
    if bytes(raw[:4]) != b"GGUF":
        raise GgufFormatError("no GGUF magic at the start")
    cursor.at = 4
    version = cursor.take("<I")
    if version not in (2, 3):
        raise GgufFormatError(f"GGUF version {version} (this reader knows 2 and 3)")
    tensors, entries = cursor.count("tensor"), cursor.count("metadata")
    metadata = {}
    for _ in range(entries):
        key = cursor.string()
        metadata[key] = cursor.value(cursor.take("<I"))
    infos = []
    for _ in range(tensors):
        name = cursor.string()
        dims = cursor.take("<I")
        if dims > 8:
            raise GgufFormatError(f"tensor {name} has {dims} dimensions")
        shape = tuple(cursor.take("<Q") for _ in range(dims))
        infos.append((name, cursor.take("<I"), shape, cursor.take("<Q")))
    align = metadata.get("general.alignment", 32)
    if not isinstance(align, int) or align <= 0:
        raise GgufFormatError(f"general.alignment {align!r} is not a positive integer")
    start = -(-cursor.at // align) * align
    table = {name: TensorInfo(name, kind, shape, start + offset) for name, kind, shape, offset in infos}
    return GgufIndex(path, metadata, table)
