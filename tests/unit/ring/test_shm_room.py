"""Shared memory the daemon makes is there whole from the start: the KV pool's memory
tier folder made fresh (0700) with a host_bytes that /dev/shm can hold, and every
segment allocated when it is made (kvasir/ring/shm.py)."""

from __future__ import annotations

import os
import stat
import subprocess

import pytest

from kvasir.errors import KvasirError
from kvasir.ring.shm import SlotError, make_pool_folder, map_file


def test_the_pool_folder_is_made_fresh_and_private_and_an_existing_one_is_reported(tmp_path):
    old = os.umask(0)
    try:
        assert make_pool_folder("kvasir-1-abcdef01", 1 << 20, tmp_path)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "kvasir-1-abcdef01-kvpool").stat().st_mode) == 0o700
    assert not make_pool_folder("kvasir-1-abcdef01", 1 << 20, tmp_path)  # made by someone before: not its own


def test_host_bytes_larger_than_dev_shm_are_refused_with_both_sizes(tmp_path):
    info = os.statvfs(tmp_path)
    size = info.f_blocks * info.f_frsize
    with pytest.raises(KvasirError, match=rf"host_bytes = {size + 1} bytes is more than .* \({size} bytes\)"):
        make_pool_folder("kvasir-1-abcdef01", size + 1, tmp_path)
    assert not list(tmp_path.iterdir())


def test_a_segment_that_does_not_fit_is_an_error_at_once_not_a_sigbus_later(tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        with pytest.raises(SlotError, match=r"1048576 bytes cannot be allocated \(No space left on device\)"):
            map_file(mount / "seg", 1 << 20, create=True)
        assert not (mount / "seg").exists()
        mapping = map_file(mount / "fits", 32 * 1024, create=True)
        assert os.stat(mount / "fits").st_blocks * 512 >= 32 * 1024  # allocated, not sparse
        mapping.close()
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)
