"""Storage faults cost a tier a slice, never the stage (kvasir/kvpool/disk.py,
kvasir/kvpool/health.py): a full filesystem, a directory in a file's place, a file its
reader may not read; a tier that keeps failing pauses and is tried again after a
back-off; two writers sharing a folder keep its budget and read each other's slices."""

from __future__ import annotations

import ctypes
import os
import subprocess
from contextlib import contextmanager

import pytest

from kvasir.kvpool.disk import file_name
from kvasir.kvpool.health import BACKOFF_S, PAUSE_AFTER
from tests.support.kvpool import Events, make_tier

NOBODY = 65534


def where(n: int, layers: tuple[int, int] = (0, 3)) -> tuple[bytes, tuple[int, int]]:
    return (n.to_bytes(16, "big"), layers)


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 64 KiB tmpfs (a full disk, or an exhausted quota, as a writer meets it)."""
    mount = tmp_path / "full"
    mount.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k,mode=0700", "tmpfs", str(mount)], capture_output=True
    )
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_full_filesystem_drops_slices_counts_them_and_pauses_the_tier(small_tmpfs):
    clock, log = Clock(), Events()
    tier = make_tier(small_tmpfs / "tier", 1 << 20, log=log, clock=clock)  # a budget the filesystem cannot hold
    stored = [tier.put(where(n), bytes([n]) * 20_000) for n in range(6)]
    assert stored[:2] == [True, True] and not any(stored[3:])  # 64 KiB: two or three fit, then ENOSPC
    assert tier.health.errors[("write", "ENOSPC")] == PAUSE_AFTER and tier.health.state == "paused"
    assert not list(small_tmpfs.glob("tier/*.partial"))  # nothing half-written left
    assert log.events().count("kv pool tier fault") == 1 and log.events().count("kv pool tier paused") == 1
    assert tier.get(where(0), 20_000) is None  # paused: a miss, the slice kept where it is
    assert (small_tmpfs / "tier" / file_name(where(0))).exists()
    clock.now += BACKOFF_S  # the back-off is over: tried again, and room was made meanwhile
    (small_tmpfs / "tier" / file_name(where(1))).unlink()
    assert tier.get(where(0), 20_000) == bytes([0]) * 20_000 and tier.health.state == "serving"
    assert "kv pool tier serving again" in log.events()


def test_a_tier_that_fails_again_after_its_back_off_waits_twice_as_long(small_tmpfs):
    clock = Clock()
    tier = make_tier(small_tmpfs / "tier", 1 << 20, clock=clock)
    for n in range(8):
        tier.put(where(n), b"x" * 30_000)
    assert tier.health.state == "paused" and not tier.put(where(9), b"x")
    clock.now += BACKOFF_S
    assert not tier.put(where(10), b"y" * 30_000)  # tried once: full still
    clock.now += BACKOFF_S
    assert not tier.health.usable()  # paused for 2 * BACKOFF_S now
    clock.now += BACKOFF_S
    assert tier.health.usable()


def test_a_directory_in_a_files_place_costs_that_slice_only(tmp_path):
    tier = make_tier(tmp_path / "tier", 1 << 20)
    (tmp_path / "tier" / file_name(where(1))).mkdir()
    assert not tier.put(where(1), b"a" * 10)  # the rename meets a directory: dropped, counted
    assert tier.health.errors == {("write", "EISDIR"): 1} and tier.health.state == "serving"
    assert tier.put(where(2), b"b" * 10) and tier.get(where(2), 10) == b"b" * 10
    assert tier.get(where(1), 10) is None and tier.health.errors[("read", "not_a_file")] == 1
    assert not list((tmp_path / "tier").glob("*.partial"))


@contextmanager
def reading_as(uid: int):
    """This thread's file access as ``uid``'s (setfsuid: the filesystem capabilities go with it)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.setfsuid(uid)
    try:
        yield
    finally:
        libc.setfsuid(os.geteuid())


def test_a_file_its_reader_may_not_read_is_a_miss(tmp_path):
    """As a user that cannot read the file (EACCES): a miss, counted, never raised."""
    if os.geteuid() != 0:
        pytest.skip("reading as another user needs root")
    tier = make_tier(tmp_path / "tier", 1 << 20)
    assert tier.put(where(1), b"a" * 10)
    with reading_as(NOBODY):
        assert tier.get(where(1), 10) is None
    assert tier.health.errors == {("read", "EACCES"): 1} and tier.counters.misses == 1
    assert tier.get(where(1), 10) == b"a" * 10  # readable again (its removal was refused too): read


def test_two_writers_sharing_a_folder_keep_its_budget_and_read_each_others_slices(tmp_path):
    first, second = make_tier(tmp_path / "tier", 1000), make_tier(tmp_path / "tier", 1000)
    for n in range(6):
        assert first.put(where(n), bytes([n]) * 100) and second.put(where(10 + n), bytes([n]) * 100)
    for n in range(6):
        assert first.put(where(20 + n), b"f" * 100)
        assert second.put(where(30 + n), b"s" * 100)
        assert sum(p.stat().st_size for p in (tmp_path / "tier").glob("*.kv")) <= 1000  # kept by both
    assert first.get(where(35), 100) == b"s" * 100  # the other writer's slice, read
    assert second.get(where(25), 100) == b"f" * 100


def test_a_writers_start_leaves_a_live_sharers_partial_files_alone(tmp_path):
    make_tier(tmp_path / "tier", 1000)
    live = tmp_path / "tier" / f"{file_name(where(1))}.{os.getpid()}.partial"  # being written by a running writer
    dead = tmp_path / "tier" / f"{file_name(where(2))}.999999999.partial"
    for path in (live, dead):
        path.write_bytes(b"half")
    make_tier(tmp_path / "tier", 1000)  # another writer starts on the same folder
    assert live.exists() and not dead.exists()


def test_files_that_are_not_what_the_pool_wrote_are_removed_without_pausing_the_tier(tmp_path):
    tier = make_tier(tmp_path / "tier", 1 << 20)
    for n in range(2 * PAUSE_AFTER):
        assert tier.put(where(n), b"a" * 10)
        os.chmod(tmp_path / "tier" / file_name(where(n)), 0o644)  # open to others: not one the pool leaves so
    assert all(tier.get(where(n), 10) is None for n in range(2 * PAUSE_AFTER))
    assert tier.health.errors == {("read", "mode"): 2 * PAUSE_AFTER} and tier.health.state == "serving"
    assert not list((tmp_path / "tier").glob("*.kv"))
    assert tier.put(where(99), b"b" * 10) and tier.get(where(99), 10) == b"b" * 10
