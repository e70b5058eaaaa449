"""Races around start-up and supervision: a SIGTERM as start-up ends, a process group
stopped and resumed, and a runtime dir that is not kvasird's to take."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from kvasir.bench.daemon import stop_gracefully
from kvasir.client import Client
from kvasir.daemon.launcher import Launcher
from kvasir.daemon.resolve import resolve_plan
from kvasir.logs import setup_logging
from tests.support.daemon import BIN, exited, wait_serving, write_plan
from tests.support.models import hf_greedy, reference_model


def test_a_stopped_and_resumed_process_group_is_not_killed_as_hung(tiny_models, tmp_path):
    """Ctrl-Z (or a cgroup freeze) stops the launcher and every child together for longer
    than the heartbeat timeout; on resume nobody has beaten, but nobody was hung."""
    source = tiny_models["llama"]
    plan = write_plan(tmp_path / "plan.toml", source, [(0, 3), (3, 6)], heartbeat_timeout_s=2)
    runtime_dir = tmp_path / "rt"
    log = open(tmp_path / "kvasird.log", "wb")
    process = subprocess.Popen(
        [str(BIN / "kvasird"), "start", "--plan", str(plan), "--runtime-dir", str(runtime_dir)],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        wait_serving(process, runtime_dir, 2, 180, lambda: (tmp_path / "kvasird.log").read_text())
        os.killpg(process.pid, signal.SIGSTOP)
        time.sleep(5.0)
        os.killpg(process.pid, signal.SIGCONT)
        time.sleep(4.0)  # two heartbeat timeouts after the resume
        with Client(runtime_dir) as client:
            final = client.generate(token_ids=[3, 1, 4, 1, 5], max_tokens=6, temperature=0)
            stats = client.stats()
        assert final.token_ids == hf_greedy(reference_model(source), [3, 1, 4, 1, 5], 6)
        assert stats.restarts == 0 and stats.last_failure is None, (tmp_path / "kvasird.log").read_text()
    finally:
        os.killpg(process.pid, signal.SIGCONT)
        assert stop_gracefully(process) == 0
        log.close()


def test_a_sigterm_as_start_up_ends_drains_instead_of_being_forgotten(tiny_models, tmp_path):
    """The signal lands while the bridge opens the client endpoint, the last step before
    the daemon counts as running: it must still drain and stop, not serve on."""
    plan_path = write_plan(tmp_path / "plan.toml", tiny_models["llama"], [(0, 3), (3, 6)])
    plan, source = resolve_plan(str(plan_path))
    launcher = Launcher(
        plan=plan,
        source=source,
        runtime_dir=tmp_path / "rt",
        log=setup_logging("warning", role="launcher", pid=os.getpid()),
    )
    opened = launcher.open

    def open_then_signalled(*args, **kw):
        opened(*args, **kw)
        launcher.request_stop(signal.SIGTERM)  # as the signal handler would, at the worst moment

    launcher.open = open_then_signalled  # type: ignore[method-assign]
    try:
        launcher.prepare()
        launcher.spawn()
        launcher.wait_ready()
        assert launcher.state == "draining"
        pids = [child.process.pid for child in launcher.children]
        launcher.serve()
        assert launcher.exit_code == 0 and all(exited(pid) for pid in pids)
    finally:
        launcher.cleanup()
    assert launcher.state == "stopped"
    assert not list((tmp_path / "rt").iterdir())
    assert not [p for p in Path("/dev/shm").iterdir() if p.name.startswith(f"kvasir-{os.getpid()}-")]


def test_kvasird_refuses_a_runtime_dir_that_holds_other_programs_files(tiny_models, tmp_path):
    plan = write_plan(tmp_path / "plan.toml", tiny_models["llama"], [(0, 3), (3, 6)])
    shared = tmp_path / "run"
    shared.mkdir(mode=0o755)
    (shared / "docker.sock").write_text("")
    (shared / "notes.txt").write_text("keep me")
    run = subprocess.run(
        [str(BIN / "kvasird"), "start", "--plan", str(plan), "--runtime-dir", str(shared)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 1
    assert "holds files that are not kvasird's (docker.sock, notes.txt)" in run.stdout + run.stderr
    assert sorted(p.name for p in shared.iterdir()) == ["docker.sock", "notes.txt"]
    assert oct(shared.stat().st_mode & 0o777) == oct(0o755)
