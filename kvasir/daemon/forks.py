"""The launcher's side of the zygote (kvasir/daemon/zygote.py): fork it once the launcher's
imports are done, ask it for each worker (stage, shard, bridge, HTTP front), and supervise
each as a child of the launcher's own.

The launcher makes itself a child subreaper first, so a worker the zygote forks (twice)
is reparented to the launcher at once: ``ForkedProcess`` waits for it, polls it and
kills it as ``subprocess.Popen`` does its children, and the stages' own check that the
launcher is their parent holds as before. A zygote that is gone or answers nonsense is
logged once and the launcher starts fresh interpreters from then on: a restart costs
seconds more, never the daemon.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import socket
import subprocess
import threading
import time

import msgspec

from kvasir.daemon.zygote import FRAME, PID, preload, read_exactly, run
from kvasir.logs import Logger
from kvasir.wire.control import WorkerSettings

PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h
POLL_S = 0.01
ANSWER_WAIT_S = 30.0  # a fork takes milliseconds


def become_subreaper() -> bool:
    """Make this process the parent of its descendants' orphans (Linux); False where it
    cannot be."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


class ForkedProcess:
    """A worker the zygote forked, reparented to this process: what the launcher uses of
    a Popen (kvasir/daemon/children.py ``Process``)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                done, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: it is gone, how is not known
                self.returncode = 1
                return self.returncode
            if done:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout or 0.0)
            time.sleep(POLL_S)
        return code

    def kill(self) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class Zygote:
    """The launcher's zygote (kvasir/daemon/zygote.py), forked from it once its imports are
    done (``fork_zygote``), asked for each local worker."""

    def __init__(self, process: ForkedProcess, inbound: socket.socket, outbound: int, log: Logger) -> None:
        self.log = log
        self.process: ForkedProcess | None = process
        self._inbound = inbound  # the launcher's end of the zygote's socket
        self._inbound.setblocking(False)
        self._outbound = outbound  # the read end of the pipe it answers on

    def fork(self, settings: WorkerSettings, fds: tuple[int, ...] = ()) -> ForkedProcess | None:
        """A worker for ``settings`` forked from the zygote, holding ``fds`` (a front's
        listening socket); None once the zygote is gone or does not answer within
        ``ANSWER_WAIT_S``."""
        if self.process is None:  # closed, or lost: its socket and pipe are gone
            return None
        encoded = msgspec.msgpack.encode(settings)
        try:
            answer = self._exchange(FRAME.pack(len(encoded)) + encoded, fds, time.monotonic() + ANSWER_WAIT_S)
        except OSError as exc:
            answer = None
            self.log.warning("the zygote's socket failed", error=str(exc))
        if answer is None:
            self._lost()
            return None
        return ForkedProcess(PID.unpack(answer)[0])

    def _exchange(self, frame: bytes, fds: tuple[int, ...], deadline: float) -> bytes | None:
        """Send ``frame`` (``fds`` with its first bytes), read the pid: None at end of file
        or past ``deadline``."""
        view = memoryview(frame)
        while view:
            if not select.select([], [self._inbound], [], max(0.0, deadline - time.monotonic()))[1]:
                return None
            try:
                sent = socket.send_fds(self._inbound, [view], list(fds)) if fds else self._inbound.send(view)
            except BlockingIOError:
                continue
            view, fds = view[sent:], ()
        if not select.select([self._outbound], [], [], max(0.0, deadline - time.monotonic()))[0]:
            return None
        return read_exactly(self._outbound, PID.size)  # written at once: a pipe keeps 4 bytes together

    def _lost(self) -> None:
        code = self.close()
        self.log.warning("the zygote is gone: workers start as fresh interpreters", code=code)

    def close(self) -> int | None:
        """End the zygote (it holds nothing but its imports: killed); how it ended."""
        if self.process is None:
            return None
        process, self.process = self.process, None
        self._inbound.close()
        os.close(self._outbound)
        code = process.poll()
        if code is None:
            process.kill()
        return process.wait() if code is None else code


def fork_zygote(log: Logger) -> Zygote | None:
    """Import what a worker needs (``preload``) and fork the zygote from this process; None
    (with a warning) where a thread already runs here: a fork keeps only the thread that
    forks, and a worker must start as a fresh interpreter would."""
    if threading.active_count() > 1:
        log.warning("a thread runs before the zygote is forked: workers start as fresh interpreters")
        return None
    preload()
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)  # a front's fd goes along
    answers, answer_end = os.pipe()
    try:
        pid = os.fork()
    except OSError as exc:  # out of processes or memory: the daemon starts all the same
        for end in (ours, theirs):
            end.close()
        for fd in (answers, answer_end):
            os.close(fd)
        log.warning("cannot fork the zygote: workers start as fresh interpreters", error=str(exc))
        return None
    if pid == 0:  # the zygote: never back into the launcher's frames
        ours.close()
        os.close(answers)
        run(theirs.detach(), answer_end)
    theirs.close()
    os.close(answer_end)
    return Zygote(ForkedProcess(pid), ours, answers, log)
