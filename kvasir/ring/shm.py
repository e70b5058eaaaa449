"""POSIX shared-memory files of one daemon: their names (which carry the creator's pid),
mapping them, and removing those a killed daemon left behind."""

from __future__ import annotations

import mmap
import os
import re
import secrets
import shutil
from collections.abc import Iterable
from pathlib import Path

from kvasir.errors import KvasirError
from kvasir.pids import alive

SHM_DIR = Path("/dev/shm")


STALE_NAMES = (
    re.compile(r"kvasir-(?P<pid>[0-9]+)-[0-9a-f]{8}-[a-z]+[0-9]*"),  # segment_prefix() + "-edge3", "-kv0", "-hop"
    # PyTorch's CUDA IPC reference counters ("/torch_<pid>_<random>_<n>"): a stage that
    # shared CUDA memory and was killed leaves one behind
    re.compile(r"torch_(?P<pid>[0-9]+)_[0-9]+_[0-9]+"),
)


POOL_SUFFIX = "-kvpool"
PREFIX_RE = re.compile(r"kvasir-[0-9]+-[0-9a-f]{8}")  # what segment_prefix() makes
SUFFIX_RE = re.compile(r"-[a-z]+[0-9]*")  # what follows it: "-edge3", "-kv0", "-experts1"


def pool_folder(prefix: str) -> Path:
    """The KV pool's host memory tier of the daemon whose segments start with ``prefix``
    (a folder of slice files: kvasir/kvpool/disk.py), removed with its other segments."""
    return SHM_DIR / f"{prefix}{POOL_SUFFIX}"


def make_pool_folder(prefix: str, host_bytes: int, directory: Path = SHM_DIR) -> bool:
    """The KV pool's host memory tier, made fresh (0700) by the daemon before any of its
    stages starts; False when something by its name exists already (its stages check it
    and refuse it unless it is this user's folder open to nobody else). KvasirError when
    ``host_bytes`` is more than ``directory`` (/dev/shm) holds, with both sizes."""
    info = os.statvfs(directory)
    size = info.f_blocks * info.f_frsize
    if host_bytes > size:
        raise KvasirError(
            f"kv_pool.host_bytes = {host_bytes} bytes is more than {directory} holds on this host "
            f"({size} bytes): lower it, or give {directory} more room"
        )
    try:
        os.mkdir(directory / f"{prefix}{POOL_SUFFIX}", 0o700)
    except FileExistsError:
        return False
    return True


def remove_pool_folder(prefix: str) -> None:
    shutil.rmtree(pool_folder(prefix), ignore_errors=True)


def check_segment_names(prefix: str, names: Iterable[str]) -> None:
    """Segment names another process sent (a follower's leader): ``prefix`` must be one
    segment_prefix() makes and each name that prefix and a segment's suffix, so that no
    name reaches outside /dev/shm or another daemon's segments. KvasirError otherwise."""
    if PREFIX_RE.fullmatch(prefix) is None:
        raise KvasirError(f"the leader's segment prefix {prefix[:80]!r} is not one Kvasir makes")
    for name in names:
        if not name.startswith(prefix) or SUFFIX_RE.fullmatch(name[len(prefix) :]) is None:
            raise KvasirError(f"the leader sent the segment name {name[:120]!r}, which is not {prefix}-KIND[N]")


def segment_prefix() -> str:
    """The start of every shared-memory segment this process creates: it names the
    creator's pid, so a later daemon can tell segments whose creator is gone."""
    return f"kvasir-{os.getpid()}-{secrets.token_hex(4)}"


def sweep_stale_segments(directory: Path = SHM_DIR) -> list[tuple[Path, int]]:
    """Remove this user's segments whose creator no longer runs (a daemon, stage or bench
    killed with SIGKILL, or by the OOM killer, cannot remove its own): Kvasir's, and
    PyTorch's CUDA IPC reference counters. Segments of live processes, other users'
    files and other names are left alone. Returns the removed files with their sizes."""
    removed: list[tuple[Path, int]] = []
    try:
        entries = list(directory.iterdir())
    except OSError:
        return removed
    for path in entries:
        pid = _creator(path.name)
        if pid is None or alive(pid):
            continue
        try:
            info = path.lstat()
            if info.st_uid != os.getuid():
                continue
            if path.is_dir():
                if not path.name.endswith(POOL_SUFFIX):
                    continue  # only a KV pool's host tier (pool_folder) is a folder of ours
                size = sum(entry.stat().st_size for entry in path.rglob("*") if entry.is_file())
                shutil.rmtree(path)
                removed.append((path, size))
                continue
            path.unlink()
        except OSError:
            continue  # gone already, or not ours to remove
        removed.append((path, info.st_size))
    return removed


def _creator(name: str) -> int | None:
    """The pid a stale-sweepable file name carries, None for other names."""
    for pattern in STALE_NAMES:
        match = pattern.fullmatch(name)
        if match is not None:
            return int(match["pid"])
    return None


def map_file(path: Path, size: int, create: bool) -> mmap.mmap:
    """Map a segment; one created is allocated whole now (a full /dev/shm is an error at
    start, never a SIGBUS when a page is first written under load)."""
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            _allocate(fd, path, size)
        elif os.fstat(fd).st_size != size:
            raise SlotError(f"shared memory {path} has {os.fstat(fd).st_size} bytes, expected {size}")
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def _allocate(fd: int, path: Path, size: int) -> None:
    try:
        if size > 0:
            os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        os.unlink(path)
        raise SlotError(f"shared memory {path}: {size} bytes cannot be allocated ({exc.strerror})") from None


def close_map(mapping: mmap.mmap) -> None:
    try:
        mapping.close()
    except BufferError:
        pass  # a view is still alive somewhere; the mapping goes with the process


class SlotError(KvasirError):
    """A slot index or boundary size outside what the edge was built for."""
