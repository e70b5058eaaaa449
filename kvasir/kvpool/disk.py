"""The disk tier: stored slices as files in one folder, bounded in bytes, least recently
used evicted first, and found again after a restart.

A slice's file is named by its block key and its layer range (``KEYHEX.FIRST-END.kv``),
so a stage reads back exactly its own layers' slice of a block. A file is written beside
its final name and renamed into place, so a reader never sees half of one; a file left
half-written by a crash has the temporary suffix and is removed at the next start, as is
any other file in the folder that is not a slice's. The index (what is stored, its
size and its last use) lives in memory, rebuilt at start from the folder (last use: the
file's modification time, which ``get`` refreshes). What leaves the tier (evicted, found
corrupt, or its file gone) is listed until taken (``take_gone``), for the pool's index.
"""

from __future__ import annotations

import os
import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

SUFFIX, PARTIAL = ".kv", ".partial"
NAME = re.compile(r"^((?:[0-9a-f]{2}){1,32})\.(\d{1,6})-(\d{1,6})\.kv$")

Where = tuple[bytes, tuple[int, int]]  # a block's key and a stage's layer range


@dataclass
class DiskCounters:
    stored: int = 0  # slices written
    hits: int = 0  # slices read back
    misses: int = 0  # slices asked for and not there
    evicted: int = 0  # slices removed for room
    refused: int = 0  # slices larger than the whole tier
    corrupt: int = 0  # slices a reader found corrupt or mismatched (removed)


def file_name(where: Where) -> str:
    """The file of a block's slice of a layer range (``KEYHEX.FIRST-END.kv``)."""
    key, (first, end) = where
    return f"{key.hex()}.{first}-{end}{SUFFIX}"


class DiskTier:
    """Slices under ``folder``, at most ``max_bytes`` of them."""

    def __init__(self, folder: Path, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"a disk tier of {max_bytes} bytes holds nothing")
        self.folder = folder
        self.max_bytes = max_bytes
        self.counters = DiskCounters()
        self._sizes: OrderedDict[Where, int] = OrderedDict()  # least recently used first
        self.bytes = 0
        self._gone: list[Where] = []
        folder.mkdir(parents=True, exist_ok=True)
        self._reload()

    def __contains__(self, where: Where) -> bool:
        return where in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def stored(self) -> list[Where]:
        """Every slice held, least recently used first."""
        return list(self._sizes)

    def put(self, where: Where, data: bytes) -> bool:
        """Store one slice (replacing one stored at ``where``); False when it is larger than the tier."""
        if len(data) > self.max_bytes:
            self.counters.refused += 1
            return False
        self._forget(where, replaced=True)
        while self.bytes + len(data) > self.max_bytes:
            self._evict()
        path = self._path(where)
        partial = path.with_name(path.name + PARTIAL)
        with partial.open("wb") as handle:
            handle.write(data)
        partial.replace(path)
        self._sizes[where] = len(data)
        self.bytes += len(data)
        self.counters.stored += 1
        return True

    def get(self, where: Where) -> bytes | None:
        """One slice's stored bytes (None: not held, or its file has gone), now most recently used."""
        if where not in self._sizes:
            self.counters.misses += 1
            return None
        path = self._path(where)
        try:
            data = path.read_bytes()
            os.utime(path)
        except FileNotFoundError:
            self._forget(where)
            self.counters.misses += 1
            return None
        self._sizes.move_to_end(where)
        self.counters.hits += 1
        return data

    def take_gone(self) -> list[Where]:
        """The slices that left the tier since the last call."""
        gone, self._gone = self._gone, []
        return gone

    def discard(self, where: Where) -> None:
        """A slice its reader found corrupt or made with something else: counted and removed."""
        self.counters.corrupt += 1
        self._forget(where)

    def _evict(self) -> None:
        where = next(iter(self._sizes))
        self._forget(where)
        self.counters.evicted += 1

    def _forget(self, where: Where, replaced: bool = False) -> None:
        size = self._sizes.pop(where, None)
        if size is not None:
            self.bytes -= size
            if not replaced:
                self._path(where).unlink(missing_ok=True)
                self._gone.append(where)

    def _path(self, where: Where) -> Path:
        return self.folder / file_name(where)

    def _reload(self) -> None:
        """The index of what a previous run stored, oldest use first; the rest removed, and
        what no longer fits evicted."""
        found: list[tuple[float, Where, int]] = []
        for path in self.folder.iterdir():
            match = NAME.match(path.name)
            if match is None or not path.is_file():
                if path.is_file():
                    path.unlink(missing_ok=True)  # a half-written file, or nothing of ours
                continue
            info = path.stat()
            where = (bytes.fromhex(match.group(1)), (int(match.group(2)), int(match.group(3))))
            found.append((info.st_mtime, where, info.st_size))
        for _, where, size in sorted(found, key=lambda item: item[0]):
            self._sizes[where] = size
            self.bytes += size
        while self.bytes > self.max_bytes:
            self._evict()
