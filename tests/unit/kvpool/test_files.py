"""The pool's files are private by construction (kvasir/kvpool/files.py): folders 0700,
files 0600 made with O_EXCL | O_NOFOLLOW, a tier root another user owns, opens to others,
or that is a symlink refused by name; a file read back is checked before it is read."""

from __future__ import annotations

import os
import stat

import pytest

from kvasir.config.keys import POOL_SECRET
from kvasir.kvpool.files import Folder, Refused, Unfit

NOBODY = 65534


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_folders_and_files_are_made_private_whatever_the_umask(tmp_path):
    old = os.umask(0)  # the most open umask: nothing the pool makes may follow it
    try:
        root = Folder.root(tmp_path / "disk" / "kv", make=True, private=False)
        leaf = root.child("model").child("0-3")
        leaf.create("a.kv", b"x" * 10)
        secret = root.secret()
    finally:
        os.umask(old)
    assert mode(tmp_path / "disk" / "kv") == 0o700 and mode(tmp_path / "disk" / "kv" / "model" / "0-3") == 0o700
    assert mode(tmp_path / "disk" / "kv" / "model" / "0-3" / "a.kv") == 0o600
    assert mode(tmp_path / "disk" / "kv" / POOL_SECRET) == 0o600 and len(secret) == 32
    assert root.secret() == secret  # kept, not made again
    with pytest.raises(FileExistsError):
        leaf.create("a.kv", b"y")  # never an existing file
    assert leaf.read("a.kv", 10) == b"x" * 10


def test_a_symlink_is_never_followed_to_write_or_read(tmp_path):
    leaf = Folder.root(tmp_path / "tier", make=True, private=True)
    (tmp_path / "victim").write_bytes(b"v" * 10)
    os.symlink(tmp_path / "victim", tmp_path / "tier" / "a.kv")
    with pytest.raises(FileExistsError):
        leaf.create("a.kv", b"planted")
    with pytest.raises(OSError):
        leaf.read("a.kv", 10)  # ELOOP: the link is not followed
    assert (tmp_path / "victim").read_bytes() == b"v" * 10


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda p: os.chmod(p, 0o644), "mode"),
        (lambda p: os.chown(p, NOBODY, NOBODY), "owner"),
        (lambda p: os.truncate(p, 9), "size"),
    ],
    ids=["open to others", "another user's", "another size"],
)
def test_a_file_read_back_is_checked_before_it_is_read(tmp_path, change, reason):
    leaf = Folder.root(tmp_path / "tier", make=True, private=True)
    leaf.create("a.kv", b"x" * 10)
    change(tmp_path / "tier" / "a.kv")
    with pytest.raises(Unfit) as unfit:
        leaf.read("a.kv", 10)
    assert unfit.value.reason == reason
    os.mkfifo(tmp_path / "tier" / "fifo.kv", 0o600)
    with pytest.raises(Unfit, match="not a regular file"):  # and the read never blocks on it
        leaf.read("fifo.kv", 10)


@pytest.mark.parametrize(
    ("setup", "reason", "message"),
    [
        (lambda p: (p.mkdir(mode=0o700), os.chown(p, NOBODY, NOBODY)), "owner", "is owned by uid 65534"),
        (lambda p: (p.mkdir(), os.chmod(p, 0o777)), "mode", r"writable by other users \(mode 0777\)"),
        (lambda p: os.symlink(p.parent / "real", p), "symlink", "is a symlink"),
    ],
    ids=["squatted by another user", "writable by others", "symlinked"],
)
def test_a_tier_root_that_is_not_the_daemons_own_is_refused_by_name(tmp_path, setup, reason, message):
    (tmp_path / "real").mkdir(mode=0o700)
    root = tmp_path / "kv"
    setup(root)
    with pytest.raises(Refused, match=message) as refused:
        Folder.root(root, make=True, private=False)
    assert refused.value.reason == reason and str(root) in str(refused.value)


def test_the_memory_tiers_root_must_be_open_to_nobody_else(tmp_path):
    (tmp_path / "shm").mkdir(mode=0o755)
    with pytest.raises(Refused, match=r"open to other users \(mode 0755\)"):
        Folder.root(tmp_path / "shm", make=False, private=True)
    with pytest.raises(Refused, match="cannot be opened"):
        Folder.root(tmp_path / "missing", make=False, private=True)  # the daemon makes it; a stage never does


def test_a_folder_made_open_by_an_older_version_is_closed_and_another_users_refused(tmp_path):
    root = Folder.root(tmp_path / "kv", make=True, private=False)
    (tmp_path / "kv" / "old").mkdir(mode=0o755)
    os.chmod(tmp_path / "kv" / "old", 0o755)
    root.child("old")
    assert mode(tmp_path / "kv" / "old") == 0o700
    (tmp_path / "kv" / "theirs").mkdir(mode=0o700)
    os.chown(tmp_path / "kv" / "theirs", NOBODY, NOBODY)
    with pytest.raises(Refused, match="owned by uid 65534"):
        root.child("theirs")


def test_a_planted_secret_is_refused(tmp_path):
    root = Folder.root(tmp_path / "kv", make=True, private=False)
    (tmp_path / "kv" / POOL_SECRET).write_bytes(b"0" * 64 + b"\n")
    os.chmod(tmp_path / "kv" / POOL_SECRET, 0o644)  # anyone could have read it
    with pytest.raises(Refused, match="is not this pool's secret"):
        root.secret()
