"""A tier of the pool: stored slices as files in one folder, bounded in bytes, least
recently used evicted first, found again after a restart, and any storage fault a cache
miss (kvasir/kvpool/health.py), never an error of the stage.

A slice's file is named by its block key and its layer range (``KEYHEX.FIRST-END.kv``),
so a stage reads back exactly its own layers' slice of a block. A writer writes a file
beside its final name (``NAME.PID.partial``: each writer its own) and renames it into
place, so a reader never sees half of one; a partial file whose writer no longer runs
is removed at the next start. Files are made and read through kvasir/kvpool/files.py
(0600, ``O_EXCL | O_NOFOLLOW``, checked when read).

Stages of the same layers on one host (two instances, or two daemons on one
``disk_dir``) share a folder, and every sharer keeps its byte budget: the folder's
``.ledger`` file counts its changes, and a writer, holding the ledger's lock, first
looks at the folder again if another sharer changed it since it last looked, evicts what
must go, then renames its slice into place (the folder exceeds its budget by at most the
slice each writer is still writing). Any sharer reads any sharer's slices.

The index (what is stored, its size and its last use) lives in memory, rebuilt at start
from the folder (last use: the file's modification time, which ``get`` refreshes). What
leaves the tier (evicted, found corrupt, its file gone) is listed until taken
(``take_gone``), for the pool's index.
"""

from __future__ import annotations

import fcntl
import os
import re
import stat
from collections import OrderedDict
from dataclasses import dataclass

from kvasir.kvpool.files import Folder, Refused, Unfit, check_file, reason_of
from kvasir.kvpool.health import TierHealth
from kvasir.pids import alive

SUFFIX, PARTIAL, LEDGER = ".kv", ".partial", ".ledger"
NAME = re.compile(r"^((?:[0-9a-f]{2}){1,32})\.(\d{1,6})-(\d{1,6})\.kv$")
PARTIAL_NAME = re.compile(r"^.+\.kv\.(\d{1,10})\.partial$")

Where = tuple[bytes, tuple[int, int]]  # a block's key and a stage's layer range


@dataclass
class DiskCounters:
    stored: int = 0  # slices written
    hits: int = 0  # slices read back
    misses: int = 0  # slices asked for and not there (or the tier paused)
    evicted: int = 0  # slices removed for room
    refused: int = 0  # slices larger than the whole tier
    corrupt: int = 0  # slices a reader found corrupt, mismatched or unfit (removed)
    failed: int = 0  # slices a storage fault kept from being written


def file_name(where: Where) -> str:
    """The file of a block's slice of a layer range (``KEYHEX.FIRST-END.kv``)."""
    key, (first, end) = where
    return f"{key.hex()}.{first}-{end}{SUFFIX}"


def parse_name(name: str) -> Where | None:
    match = NAME.match(name)
    if match is None:
        return None
    return bytes.fromhex(match.group(1)), (int(match.group(2)), int(match.group(3)))


class DiskTier:
    """Slices in ``folder`` (held open), at most ``max_bytes`` of them with its sharers'."""

    def __init__(self, folder: Folder, max_bytes: int, health: TierHealth) -> None:
        if max_bytes <= 0:
            raise ValueError(f"a tier of {max_bytes} bytes holds nothing")
        self.folder = folder
        self.max_bytes = max_bytes
        self.health = health
        self.counters = DiskCounters()
        self.writer = str(os.getpid())
        self._sizes: OrderedDict[Where, int] = OrderedDict()  # least recently used first
        self.bytes = 0
        self._gone: list[Where] = []
        self._ledger = _open_ledger(folder)
        self._seen = -1  # the ledger's count when this tier last looked at the folder
        with self._locked(look=False):
            self._reload()

    def __contains__(self, where: Where) -> bool:
        return where in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def stored(self) -> list[Where]:
        """Every slice held, least recently used first."""
        return list(self._sizes)

    def put(self, where: Where, data: bytes) -> bool:
        """Store one slice (replacing one stored at ``where``); False when it is larger than
        the tier, the tier is paused, or a storage fault kept it out (counted)."""
        if len(data) > self.max_bytes:
            self.counters.refused += 1
            return False
        if not self.health.usable():
            return False
        name = file_name(where)
        partial = f"{name}.{self.writer}{PARTIAL}"
        try:
            self.folder.remove(partial)  # one a killed writer of this pid left
            self.folder.create(partial, data)
            with self._locked():
                try:
                    self._forget(where, replaced=True)
                    while self._sizes and self.bytes + len(data) > self.max_bytes:
                        self._evict()
                    self.folder.rename(partial, name)
                finally:
                    self._changed()
        except OSError as exc:
            self.folder.remove(partial)
            self.counters.failed += 1
            self.health.failed("write", reason_of(exc), exc.strerror or str(exc))
            return False
        self._sizes[where] = len(data)
        self.bytes += len(data)
        self.counters.stored += 1
        self.health.succeeded()
        return True

    def get(self, where: Where, size: int) -> bytes | None:
        """One slice's stored bytes, checked to be a file of ``size`` bytes the pool wrote
        (None: not there, unfit and removed, or a fault), now most recently used. A slice
        a sharer of the folder wrote is read too."""
        if not self.health.usable():  # paused: a miss, and the slice stays where it is
            self.counters.misses += 1
            return None
        data = self.read(where, size, touch=True)
        if data is None:
            self._forget(where)
            self.counters.misses += 1
            return None
        if where not in self._sizes:
            self.bytes += size
        self._sizes[where] = size
        self._sizes.move_to_end(where)
        self.counters.hits += 1
        return data

    def read(self, where: Where, size: int, *, touch: bool = False) -> bytes | None:
        """The file of ``where`` if it is one of ``size`` bytes the pool wrote, without the
        index (the slice server's thread reads so); unfit: removed. None otherwise."""
        if not self.health.usable():
            return None
        name = file_name(where)
        try:
            data = self.folder.read(name, size, touch=touch)
        except FileNotFoundError:
            return None
        except Unfit as exc:  # one file's fault (removed), not the tier's
            self.health.failed("read", exc.reason, f"{name}: {exc}", tier_fault=False)
            self.folder.remove(name)
            return None
        except OSError as exc:
            self.health.failed("read", reason_of(exc), f"{name}: {exc.strerror}")
            return None
        self.health.succeeded()
        return data

    def take_gone(self) -> list[Where]:
        """The slices that left the tier since the last call."""
        gone, self._gone = self._gone, []
        return gone

    def discard(self, where: Where) -> None:
        """A slice its reader found corrupt or made with something else: counted and removed."""
        self.counters.corrupt += 1
        if self._forget(where) == 0:
            self.folder.remove(file_name(where))

    def close(self) -> None:
        os.close(self._ledger)
        self.folder.close()

    def _evict(self) -> None:
        self._forget(next(iter(self._sizes)))
        self.counters.evicted += 1

    def _forget(self, where: Where, replaced: bool = False) -> int:
        size = self._sizes.pop(where, None)
        if size is None:
            return 0
        self.bytes -= size
        if not replaced:
            self.folder.remove(file_name(where))
            self._gone.append(where)
        return size

    def _locked(self, look: bool = True) -> _LedgerLock:
        return _LedgerLock(self, look)

    def _changed(self) -> None:
        """This writer changed the folder: the ledger's count moves on, and it has seen it."""
        self._seen = _count(self._ledger) + 1
        os.pwrite(self._ledger, self._seen.to_bytes(8, "little"), 0)

    def _look(self) -> None:
        """Under the lock: if a sharer changed the folder since this tier last looked,
        take in the slices it added and forget those it removed."""
        count = _count(self._ledger)
        if count == self._seen:
            return
        self._seen = count
        names = set(self.folder.names())
        for where in [w for w in self._sizes if file_name(w) not in names]:
            self.bytes -= self._sizes.pop(where)
            self._gone.append(where)
        known = {file_name(w) for w in self._sizes}
        for name in sorted(names - known):
            if (added := parse_name(name)) is not None and (size := self._size(name)) is not None:
                self._sizes[added] = size
                self.bytes += size

    def _size(self, name: str) -> int | None:
        """The size of a sharer's slice file (None: gone, or not a file the pool wrote)."""
        try:
            info = self.folder.lstat(name)
        except OSError:
            return None
        return info.st_size if _mine(info) else None

    def _reload(self) -> None:
        """Under the lock: the index of what is stored, oldest use first; a dead writer's
        partial files and anything else not a slice's removed, and what no longer fits evicted."""
        found: list[tuple[float, Where, int]] = []
        for name in self.folder.names():
            try:
                info = self.folder.lstat(name)
            except OSError:
                continue
            parsed = parse_name(name)
            if parsed is not None and _mine(info):
                found.append((info.st_mtime, parsed, info.st_size))
            elif name != LEDGER and not _live_partial(name):
                self.folder.remove(name)  # half-written by a writer gone, from before files were private, or not ours
        for _, where, size in sorted(found, key=lambda item: item[0]):
            self._sizes[where] = size
            self.bytes += size
        while self.bytes > self.max_bytes:
            self._evict()
        self._changed()


class _LedgerLock:
    """The folder's ledger locked (flock: released if its holder dies), the folder looked at again."""

    def __init__(self, tier: DiskTier, look: bool) -> None:
        self.tier = tier
        self.look = look

    def __enter__(self) -> None:
        fcntl.flock(self.tier._ledger, fcntl.LOCK_EX)
        try:
            if self.look:
                self.tier._look()
        except BaseException:
            fcntl.flock(self.tier._ledger, fcntl.LOCK_UN)
            raise

    def __exit__(self, *exc) -> None:
        fcntl.flock(self.tier._ledger, fcntl.LOCK_UN)


def _open_ledger(folder: Folder) -> int:
    """The folder's ``.ledger`` (made 0600 by the first sharer; checked as every file is)."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(LEDGER, flags | os.O_CREAT | os.O_EXCL, 0o600, dir_fd=folder.fd)
        os.write(fd, bytes(8))
        return fd
    except FileExistsError:
        fd = os.open(LEDGER, flags, dir_fd=folder.fd)
    try:
        check_file(os.fstat(fd), 8)
    except Unfit as exc:
        os.close(fd)
        raise Refused(folder.path / LEDGER, exc.reason, f"is not this pool's ledger: {exc}") from None
    return fd


def _mine(info: os.stat_result) -> bool:
    """A regular file of this user's, open to nobody else: one the pool may have written."""
    return stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid() and not info.st_mode & 0o077


def _count(fd: int) -> int:
    return int.from_bytes(os.pread(fd, 8, 0).ljust(8, b"\0"), "little")


def _live_partial(name: str) -> bool:
    """A partial file whose writer (the pid in its name) still runs: not ours to remove."""
    match = PARTIAL_NAME.match(name)
    return match is not None and alive(int(match.group(1)))
