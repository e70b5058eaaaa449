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

from kvasir.bench.daemon import stop_gracefully
from tests.support.daemon import BIN, Daemon, free_port, write_plan

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


def verify(unit: str, local: Path) -> None:
    """``systemd-analyze verify`` finds nothing to say about ``unit`` saved as ``local``
    (skips where it is not installed)."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed here (Debian package 'systemd'); the unit was not verified")
    # verify checks that ExecStart exists: point it at this checkout's kvasird
    local.write_text(unit.replace("/opt/kvasir/bin/kvasird", str(Path(sys.executable).parent / "kvasird")))
    result = subprocess.run([analyze, "verify", str(local)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert local.name not in result.stderr, result.stderr


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
    verify(unit, tmp_path / "kvasird.service")


def test_the_join_unit_verifies_and_keeps_the_secret_key_root_only(tmp_path):
    unit = (ROOT / "systemd" / "kvasird-join@.service").read_text()
    for line in (
        "Type=notify",
        "ExecStart=/opt/kvasir/bin/kvasird join --plan /etc/kvasir/plan.toml --host %i",
        "--key ${CREDENTIALS_DIRECTORY}/host.key_secret",
        "LoadCredential=host.key_secret:/etc/kvasir/keys/%i.key_secret",
        "Restart=always",
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        "WatchdogSec=",
    ):
        assert line in unit, line
    verify(unit, tmp_path / "kvasird-join@b.service")  # an instance: verify resolves %i


def test_kvasird_join_notifies_ready_while_it_waits_for_its_leader_and_stopping(tiny_models, tmp_path, monkeypatch):
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(tmp_path / "notify.sock"))
    listener.settimeout(60)
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "notify.sock"))
    plan = tmp_path / "plan.toml"
    plan.write_text(
        f'[model]\nsource = "{tiny_models["llama"]}"\nmax_seq_len = 64\n'
        f'[cluster]\nleader = "a"\nkeys = "keys"\n'
        f'[hosts.a]\naddress = "127.0.0.1"\nport = {free_port()}\n[hosts.b]\naddress = "127.0.0.2"\nport = {free_port()}\n'
        '[[stages]]\nlayers = [0, 3]\n[[stages]]\nlayers = [3, 6]\nhost = "b"\n'
    )
    keys = subprocess.run(
        [str(BIN / "kvasir"), "keys", "generate", str(tmp_path / "keys"), "--host", "a", "--host", "b"],
        capture_output=True,
        text=True,
    )
    assert keys.returncode == 0, keys.stderr
    log = open(tmp_path / "join.log", "wb")
    process = subprocess.Popen(
        [str(BIN / "kvasird"), "join", "--plan", str(plan), "--host", "b", "--runtime-dir", str(tmp_path / "rt")],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        assert listener.recv(4096) == b"READY=1\nSTATUS=host b: waiting for the leader"
        assert (tmp_path / "rt" / "kvasird.lock").exists()
    finally:
        code = stop_gracefully(process, 30)
        log.close()
    assert code == 0, (tmp_path / "join.log").read_text()
    assert listener.recv(4096).startswith(b"STOPPING=1")
    assert not (tmp_path / "rt" / "kvasird.lock").exists()
