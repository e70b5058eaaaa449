"""A kvasird the bench starts from a plan, in a private runtime dir, and stops after."""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from kvasir.client import Client, NoDaemon
from kvasir.errors import KvasirError


class BenchDaemonError(KvasirError):
    """The daemon the bench started did not come up."""


def kvasird_command() -> list[str]:
    """The ``kvasird`` next to this interpreter (a venv's bin), else the one on PATH."""
    found = shutil.which(
        "kvasird", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    )
    if found is None:
        raise BenchDaemonError("cannot find the kvasird command next to this Python or on PATH")
    return [found]


def wait_serving(process: subprocess.Popen, runtime_dir: Path, stages: int, timeout_s: float, log_tail) -> None:
    """Return once the daemon answers stats with all ``stages``; BenchDaemonError if it
    exits first or does not answer within ``timeout_s`` (``log_tail()`` says why)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise BenchDaemonError(f"kvasird exited with {process.returncode} before serving:\n{log_tail()}")
        try:
            with Client(runtime_dir, timeout_s=2.0) as client:
                if len(client.stats().stages) == stages:
                    return
        except NoDaemon:
            pass
        time.sleep(0.25)
    raise BenchDaemonError(f"kvasird not serving after {timeout_s:.0f} s:\n{log_tail()}")


def stop_gracefully(process: subprocess.Popen, timeout_s: float = 60.0) -> int:
    """SIGTERM (drain, then exit), SIGKILL after ``timeout_s``; the exit status."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode


def read_tail(path: Path, lines: int = 20) -> str:
    """The last ``lines`` lines of a log file ("(no log)" if it cannot be read)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def free_ports(count: int, lowest: int = 10_000) -> list[int]:
    """``count`` distinct TCP ports on 127.0.0.1 that were free a moment ago, chosen below
    the kernel's ephemeral range: a port from that range can be taken by any outgoing
    connection between this check and the server binding it."""
    top = max(_ephemeral_floor(), lowest + count * 2)
    picker = random.Random()
    chosen: list[int] = []
    for _ in range(count * 64):
        port = picker.randrange(lowest, top)
        if port not in chosen and _bindable(port):
            chosen.append(port)
        if len(chosen) == count:
            return chosen
    raise BenchDaemonError(f"found only {len(chosen)} of {count} free ports from {lowest} below {top}")


def _ephemeral_floor() -> int:
    """The first port the kernel hands to outgoing connections (32768 where it cannot say)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class ManagedDaemon:
    """``kvasird start --plan PLAN`` in ``work_dir/run``, its log in ``work_dir/kvasird.log``.

    Use as a context manager: entering waits until every stage answers in the stats,
    leaving stops it with SIGTERM (drain) and waits for it to exit.
    """

    def __init__(self, plan_path: Path, work_dir: Path, stages: int, ready_timeout_s: float = 600.0) -> None:
        self.plan_path = plan_path
        self.runtime_dir = work_dir / "run"
        self.log_path = work_dir / "kvasird.log"
        self.stages = stages
        self.ready_timeout_s = ready_timeout_s
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> ManagedDaemon:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [
                    *kvasird_command(),
                    "start",
                    "--plan",
                    str(self.plan_path),
                    "--runtime-dir",
                    str(self.runtime_dir),
                    "--ready-timeout",
                    str(self.ready_timeout_s),
                    "--log-level",
                    "warning",
                    "--stop-with-parent",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _wait_ready(self) -> None:
        if self.process is None:
            raise BenchDaemonError("the daemon was not started")
        wait_serving(self.process, self.runtime_dir, self.stages, self.ready_timeout_s, self.log_tail)

    def log_tail(self, lines: int = 20) -> str:
        return read_tail(self.log_path, lines)

    def stop(self, timeout_s: float = 60.0) -> None:
        if self.process is not None:
            stop_gracefully(self.process, timeout_s)
