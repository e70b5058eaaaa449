"""The launcher's side of the zygote (kvasir/daemon/forks.py) and the zygote's loop
(kvasir/daemon/zygote.py); the zygote forking real stages is tests/integration/test_zygote.py."""

from __future__ import annotations

import os
import socket
import subprocess
import threading

import msgspec
import pytest
import structlog
from structlog.testing import capture_logs

from kvasir.daemon.forks import ForkedProcess, Zygote, fork_zygote
from kvasir.daemon.zygote import FRAME, MAX_SETTINGS_BYTES, serve
from kvasir.wire.control import BridgeSettings, FrontSettings, ModelFacts, StageSettings
from tests.support.models import make_plan


def child(*argv: str) -> ForkedProcess:
    return ForkedProcess(os.posix_spawnp(argv[0], argv, dict(os.environ)))


def test_a_forked_process_is_polled_waited_for_and_killed_as_popen_would_be():
    done = child("true")
    assert done.wait(30) == 0 and done.poll() == 0
    failed = child("sh", "-c", "exit 3")
    assert failed.wait(30) == 3
    sleeper = child("sleep", "30")
    assert sleeper.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        sleeper.wait(0.05)
    sleeper.kill()
    assert sleeper.wait(30) == -9 and sleeper.returncode == -9
    sleeper.kill()  # gone already: nothing to do


def served(frame: bytes, fds: tuple[int, ...] = ()) -> None:
    """The zygote's loop (in this process: no fork is reached) given ``frame`` (``fds`` with
    its first bytes), then end of file."""
    inbound, writer = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    reader, outbound = os.pipe()
    if frame:
        socket.send_fds(writer, [frame], list(fds))
    writer.close()
    try:
        serve(inbound.fileno(), outbound)
    finally:
        inbound.close()
        for fd in (reader, outbound):
            os.close(fd)


def test_the_zygote_ends_at_end_of_file_and_refuses_frames_the_launcher_never_sends(tmp_path):
    served(b"")  # the launcher closed its socket: done
    served(FRAME.pack(10) + b"short")  # cut off mid-frame: done
    with pytest.raises(SystemExit, match="settings are far smaller"):
        served(FRAME.pack(MAX_SETTINGS_BYTES + 1))
    with pytest.raises(SystemExit, match="settings that do not decode"):
        served(FRAME.pack(5) + b"\xc1\xc1\xc1\xc1\xc1")
    plan = make_plan(tmp_path, [(0, 3), (3, 6)])
    model = ModelFacts(100, None)
    front = msgspec.msgpack.encode(
        FrontSettings(index=0, model=model, plan=plan, runtime_dir="/x", launcher_pid=1, listen_fd=9)
    )
    bridge = msgspec.msgpack.encode(BridgeSettings(model=model, plan=plan, runtime_dir="/x", launcher_pid=1))
    with pytest.raises(SystemExit, match="FrontSettings with 0 file descriptors, not 1"):
        served(FRAME.pack(len(front)) + front)  # a front without its listening socket
    open_fds = len(os.listdir("/proc/self/fd"))
    with open(os.devnull, "rb") as one, open(os.devnull, "rb") as two:
        with pytest.raises(SystemExit, match="BridgeSettings with 1 file descriptors, not 0"):
            served(FRAME.pack(len(bridge)) + bridge, (one.fileno(),))
        with pytest.raises(SystemExit, match="more file descriptors than a front's one socket"):
            served(FRAME.pack(len(front)) + front, (one.fileno(), two.fileno()))
    assert len(os.listdir("/proc/self/fd")) == open_fds, "every descriptor the zygote was sent is closed"


def stage_settings(tmp_path) -> StageSettings:
    plan = make_plan(tmp_path, [(0, 3), (3, 6)])
    return StageSettings(index=0, plan=plan, runtime_dir=str(tmp_path), launcher_pid=1, edges=[])


@pytest.fixture
def logs():
    """What the code under test logs, whatever level an earlier test in this process set
    (kvasir.logs.setup_logging filters below its level)."""
    structlog.reset_defaults()
    with capture_logs() as entries:
        yield entries
    structlog.reset_defaults()


def test_a_zygote_that_is_gone_is_dropped_with_one_warning(tmp_path, logs):
    """A zygote that died (its socket and pipe closed with it) answers no fork: it is
    closed and said once, and every fork after it is a fresh start (None here)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    answers, answer_end = os.pipe()
    process = child("true")
    assert process.wait(30) == 0
    theirs.close()
    os.close(answer_end)
    dead = Zygote(process, ours, answers, structlog.get_logger())
    assert dead.fork(stage_settings(tmp_path)) is None and dead.process is None
    assert dead.fork(stage_settings(tmp_path)) is None
    assert [entry["event"] for entry in logs if "gone" in entry["event"]] == [
        "the zygote is gone: workers start as fresh interpreters"
    ]
    assert dead.close() is None  # closed once, when it was lost


def test_no_zygote_is_forked_while_a_thread_runs(logs):
    """A fork keeps only the thread that forks: with another running, every worker starts
    as a fresh interpreter."""
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        assert fork_zygote(structlog.get_logger()) is None
    finally:
        stop.set()
        thread.join()
    assert [entry["event"] for entry in logs] == [
        "a thread runs before the zygote is forked: workers start as fresh interpreters"
    ]
