"""kvasird under systemd: the notify protocol from a real daemon, and the unit file."""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.daemon import Daemon, write_plan

ROOT = Path(__file__).parents[2]


def test_kvasird_notifies_ready_watchdog_and_stopping(tiny_models, tmp_path, monkeypatch):
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = tmp_path / "notify.sock"
    listener.bind(str(path))
    listener.settimeout(60)
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    monkeypatch.setenv("WATCHDOG_USEC", "1000000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    plan = write_plan(tmp_path / "plan.toml", tiny_models["llama"], [(0, 3), (3, 6)])
    daemon = Daemon(plan, tmp_path / "run", stages=2)
    try:
        seen = []
        while not any(m.startswith(b"READY=1") for m in seen):
            seen.append(listener.recv(4096))
        # READY only once the client endpoint is serving
        assert (tmp_path / "run" / "client.sock").exists()
        assert b"STATUS=loading 2 stages" in seen
        assert re.match(rb"READY=1\nSTATUS=serving 2 stages", seen[-1])
        deadline = time.monotonic() + 10
        pings = 0
        while pings < 2 and time.monotonic() < deadline:
            pings += listener.recv(4096) == b"WATCHDOG=1"
        assert pings == 2  # every half second for a one-second watchdog
        daemon.wait_ready()
    finally:
        code = daemon.stop()
    rest = []
    listener.settimeout(0.5)
    try:
        while True:
            rest.append(listener.recv(4096))
    except TimeoutError:
        pass
    listener.close()
    assert code == 0
    assert any(m.startswith(b"STOPPING=1\nSTATUS=draining") for m in rest)


def test_unit_file_verifies_and_keeps_its_promises(tmp_path):
    unit = (ROOT / "systemd" / "kvasird.service").read_text()
    for line in (
        "Type=notify",
        "ExecStart=/opt/kvasir/bin/kvasird start --plan /etc/kvasir/plan.toml",
        "RuntimeDirectory=kvasir",
        "Restart=on-failure",
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        "ProtectHome=yes",
        "PrivateTmp=yes",
        "WatchdogSec=",
        "MemoryMax=",
        "PrivateDevices=yes",
    ):
        assert line in unit, line
    stop = int(re.search(r"^TimeoutStopSec=(\d+)$", unit, re.M).group(1))
    drain = int(re.search(r"--drain-timeout (\d+)", unit).group(1))
    assert stop > drain
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed here (Debian package 'systemd'); the unit was not verified")
    # verify checks that ExecStart exists: point it at this checkout's kvasird
    local = tmp_path / "kvasird.service"
    local.write_text(unit.replace("/opt/kvasir/bin/kvasird", str(Path(sys.executable).parent / "kvasird")))
    result = subprocess.run([analyze, "verify", str(local)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "kvasird.service" not in result.stderr, result.stderr
