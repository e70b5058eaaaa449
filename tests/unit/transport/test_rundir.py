"""The runtime dir's checks, on real directories, owners and modes (the tests run as root,
so they can make directories of other users; the non-root client runs as nobody)."""

from __future__ import annotations

import inspect
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import zmq

from kvasir.client import Client, NoDaemon
from kvasir.transport.channels import Endpoints
from kvasir.transport.rundir import (
    LONGEST_SOCKET,
    SOCKET_PATH_MAX,
    RuntimeDirError,
    check_client_dir,
    is_ours,
    make_runtime_dir,
)

STRANGER = 12345  # a uid nobody on this machine has
NOBODY = 65534

needs_root = pytest.mark.skipif(os.getuid() != 0, reason="making another user's directory needs root")


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def every_endpoint(ends: Endpoints) -> list[str]:
    """Every ipc:// endpoint Endpoints can name: its properties, and its methods called
    with a stage or edge number (int) or a child's name (str)."""
    urls = []
    for name, member in vars(Endpoints).items():
        if name.startswith("_"):
            continue
        if isinstance(member, property):
            urls.append(getattr(ends, name))
        elif callable(member):
            kinds = [p.annotation for p in inspect.signature(member).parameters.values()][1:]
            if kinds == ["int"]:
                urls.append(getattr(ends, name)(3))
            elif kinds == ["str"]:
                urls += [getattr(ends, name)(child) for child in ("bridge", "stage-2")]
    return [url for url in urls if isinstance(url, str) and url.startswith("ipc://")]


def test_every_endpoint_the_daemon_binds_is_its_own(tmp_path):
    urls = every_endpoint(Endpoints(tmp_path))
    assert len(urls) >= 9  # client, events, bridge-in, control, stage, credits, kv, two commands
    for url in urls:
        assert is_ours(Path(url.removeprefix("ipc://")).name), url


def test_kvasirs_own_names():
    for name in (
        "kvasird.lock",
        "client.sock",
        "events.sock",
        "bridge-in.sock",
        "control.sock",
        "stage-0.sock",
        "stage-12.sock",
        "credits-3.sock",
        "kv-4.sock",
        "command-bridge.sock",
        "command-stage-2.sock",
    ):
        assert is_ours(name), name
    for name in ("docker.sock", "stage-.sock", "client.sock.bak", "x", "stage-1.socket", "../client.sock"):
        assert not is_ours(name), name


def test_the_daemon_makes_a_missing_dir_0700_and_tightens_its_own(tmp_path):
    fresh = tmp_path / "a" / "rt"
    make_runtime_dir(fresh)
    assert mode(fresh) == 0o700
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o777)
    os.chmod(loose, 0o777)
    (loose / "kvasird.lock").write_text("1\n")  # left by a killed daemon
    (loose / "stage-0.sock").write_text("")
    make_runtime_dir(loose)
    assert mode(loose) == 0o700


def padded_dir(tmp_path: Path, socket_path_bytes: int) -> Path:
    """A folder under ``tmp_path`` whose longest socket's path is ``socket_path_bytes`` long."""
    short = tmp_path / "d"
    pad = socket_path_bytes - len(os.fsencode(short / LONGEST_SOCKET))
    assert pad > 0, tmp_path
    return tmp_path / ("d" + "x" * pad)


def test_a_runtime_dir_too_long_for_its_sockets_is_refused_before_anything_is_made(tmp_path):
    fits = padded_dir(tmp_path, SOCKET_PATH_MAX)
    make_runtime_dir(fits)
    with zmq.Context() as ctx, ctx.socket(zmq.PULL) as sock:  # the kernel takes the longest socket
        sock.bind(f"ipc://{fits / LONGEST_SOCKET}")
    long = padded_dir(tmp_path, SOCKET_PATH_MAX + 1)
    with pytest.raises(RuntimeDirError, match="too long for its sockets.*give kvasird a shorter --runtime-dir"):
        make_runtime_dir(long)
    assert not long.exists()
    over = tmp_path / ("y" * (SOCKET_PATH_MAX + 1 - len(os.fsencode(tmp_path / "y"))) + "y")
    with zmq.Context() as ctx, ctx.socket(zmq.PULL) as sock, pytest.raises(zmq.ZMQError, match="longer than"):
        sock.bind(f"ipc://{over}")  # one byte more, in a folder that is there: as a worker would have failed


def test_the_daemon_refuses_links_files_and_folders_that_hold_others_files(tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(RuntimeDirError, match="is a symbolic link"):
        make_runtime_dir(tmp_path / "link")
    (tmp_path / "file").write_text("")
    with pytest.raises(RuntimeDirError, match="is not a directory"):
        make_runtime_dir(tmp_path / "file")
    shared = tmp_path / "run"
    shared.mkdir()
    for name in ("docker.sock", "client.sock", "utmp"):
        (shared / name).write_text("")
    os.chmod(shared, 0o755)
    with pytest.raises(RuntimeDirError, match=r"holds files that are not kvasird's \(docker.sock, utmp\)"):
        make_runtime_dir(shared)
    assert mode(shared) == 0o755 and (shared / "docker.sock").exists() and (shared / "client.sock").exists()


@needs_root
def test_the_daemon_refuses_another_users_dir(tmp_path):
    squatted = tmp_path / "rt"
    squatted.mkdir(mode=0o777)
    os.chown(squatted, STRANGER, STRANGER)
    with pytest.raises(RuntimeDirError, match=f"belongs to uid {STRANGER}, not to this user"):
        make_runtime_dir(squatted)


def test_a_client_refuses_links_and_dirs_others_may_write(tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    check_client_dir(real)
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(RuntimeDirError, match="symbolic link"):
        check_client_dir(tmp_path / "link")
    os.chmod(real, 0o777)
    with pytest.raises(RuntimeDirError, match="writable by other users"):
        check_client_dir(real)
    with pytest.raises(FileNotFoundError):
        check_client_dir(tmp_path / "missing")


@needs_root
def test_root_accepts_a_service_users_dir_only_where_others_cannot_make_one(tmp_path):
    run = tmp_path / "run"  # like /run: only root writes here (systemd makes /run/kvasir for a DynamicUser)
    run.mkdir(mode=0o755)
    service = run / "kvasir"
    service.mkdir(mode=0o700)
    os.chown(service, STRANGER, STRANGER)
    check_client_dir(service)
    tmp = tmp_path / "tmp"  # like /tmp: anyone may make a folder here first
    tmp.mkdir()
    os.chmod(tmp, 0o1777)
    squatted = tmp / "kvasir-0"
    squatted.mkdir(mode=0o700)
    os.chown(squatted, STRANGER, STRANGER)
    with pytest.raises(RuntimeDirError, match=f"belongs to uid {STRANGER}, not to you"):
        check_client_dir(squatted)


@needs_root
def test_a_squatted_dir_gets_no_prompt_and_a_clear_error(tmp_path):
    """Another user made the client's default runtime dir and answers there as kvasird:
    the client refuses before connecting, so the impostor never sees a message."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    os.chmod(tmp, 0o1777)
    squatted = tmp / "kvasir-0"
    squatted.mkdir(mode=0o700)
    ctx = zmq.Context()
    impostor = ctx.socket(zmq.ROUTER)
    impostor.bind(f"ipc://{squatted / 'client.sock'}")
    os.chown(squatted, STRANGER, STRANGER)
    try:
        with pytest.raises(RuntimeDirError, match="refusing to connect"):
            Client(squatted, timeout_s=2.0)
        kvasir = Path(sys.executable).parent / "kvasir"
        run = subprocess.run(
            [str(kvasir), "generate", "hello", "--runtime-dir", str(squatted)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert run.returncode == 3 and "refusing to connect" in run.stderr, run.stderr
        assert impostor.poll(200) == 0  # nothing reached it
    finally:
        impostor.close(linger=0)
        ctx.term()


@needs_root
def test_a_user_other_than_root_accepts_only_its_own_or_roots_dir():
    import shutil
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="kvasir-test-"))  # in /tmp itself: nobody must reach it
    try:
        os.chmod(tmp, 0o1777)
        for owner, verdict in ((NOBODY, 0), (0, 0), (STRANGER, 3)):
            rt = tmp / f"rt-{owner}"
            rt.mkdir(mode=0o755)
            os.chown(rt, owner, owner)
            assert as_nobody(lambda rt=rt: check_client_dir(rt)) == verdict, owner
    finally:
        shutil.rmtree(tmp)


def as_nobody(check) -> int:
    """Run ``check`` in a forked child that has become uid nobody: 0 passed, 3 refused."""
    pid = os.fork()
    if pid == 0:  # the child: no threads, no return into pytest
        code = 1
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            check()
            code = 0
        except RuntimeDirError:
            code = 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_no_dir_is_no_daemon(tmp_path):
    with pytest.raises(NoDaemon, match="no such directory"):
        Client(tmp_path / "nothing", timeout_s=1.0)
