"""Shared-memory segments left behind by a killed daemon or stage, and how the next one finds them."""

from __future__ import annotations

import os
import subprocess

from kvasir.ring.shm import STALE_NAMES, segment_prefix, sweep_stale_segments


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_segment_names_carry_the_creators_pid():
    prefix = segment_prefix()
    for suffix in ("edge0", "edge12", "kv3", "hop"):
        match = STALE_NAMES[0].fullmatch(f"{prefix}-{suffix}")
        assert match is not None and int(match["pid"]) == os.getpid()
    assert segment_prefix() != prefix  # two daemons of one process never share a name


def test_only_this_users_segments_of_gone_processes_are_removed(tmp_path):
    dead = _dead_pid()
    stale = {
        f"kvasir-{dead}-0a1b2c3d-edge0": 100,
        f"kvasir-{dead}-0a1b2c3d-kv1": 7,
        f"kvasir-{dead}-ffffffff-hop": 0,
        f"torch_{dead}_3735928559_0": 12,  # PyTorch's CUDA IPC reference counter of a killed stage
    }
    kept = [
        f"kvasir-{os.getpid()}-0a1b2c3d-edge0",  # a live daemon's
        "kvasir-1-0a1b2c3d-edge0",  # init is alive (and maybe not ours)
        f"kvasir-{dead}-notahex!-edge0",  # not a Kvasir name
        f"kvasir-{dead}-0a1b2c3d",
        f"kvasir-hop-{dead}-123",
        f"torch_{dead}_1",  # not the reference counters' name
        f"torch_{os.getpid()}_3735928559_0",  # a live process's counter
        "kvasir-pool",
    ]
    for name, size in stale.items():
        (tmp_path / name).write_bytes(b"x" * size)
    for name in kept:
        (tmp_path / name).write_bytes(b"y")
    (tmp_path / f"kvasir-{dead}-0a1b2c3d-edge9").mkdir()  # not a file: left alone, no error
    pool = tmp_path / f"kvasir-{dead}-0a1b2c3d-kvpool"  # a killed daemon's KV pool host tier: a folder
    (pool / "model" / "0-3").mkdir(parents=True)
    (pool / "model" / "0-3" / "slice.kv").write_bytes(b"z" * 5)

    removed = sweep_stale_segments(tmp_path)

    assert sorted((path.name, size) for path, size in removed) == sorted([*stale.items(), (pool.name, 5)])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(kept + [f"kvasir-{dead}-0a1b2c3d-edge9"])
    assert sweep_stale_segments(tmp_path) == []


def test_a_missing_directory_removes_nothing(tmp_path):
    assert sweep_stale_segments(tmp_path / "absent") == []
