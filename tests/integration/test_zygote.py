"""Workers forked from the zygote (kvasir/daemon/zygote.py): the stages, the bridge and the
HTTP front are each the launcher's own child, named for what it is; a killed stage is
forked again, and with the zygote gone the ring restarts from fresh interpreters, serving
exactly as before."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from test_supervision import one_greedy, wait_serving_again

from kvasir.daemon.environment import worker_env
from tests.support.daemon import exited, free_port
from tests.support.models import hf_greedy, reference_model
from tests.support.procs import children_of, cmdline, comm


def zygote_of(launcher: int) -> int:
    """The launcher's zygote: forked from it, named so, its command line the launcher's."""
    zygote = next(pid for pid in children_of(launcher) if comm(pid) == "zygote")
    assert cmdline(zygote) == cmdline(launcher)
    assert len(os.listdir(f"/proc/{zygote}/fd")) == 5, "the standard streams, its socket and its pipe: no more"
    return zygote


SETTINGS = ("GLIBC_TUNABLES", "GOMP_SPINCOUNT", "OMP_WAIT_POLICY")


def environ(pid: int) -> dict[str, str]:
    """The environment ``pid`` started with."""
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(entry.decode().split("=", 1) for entry in entries if b"=" in entry)


def restarted(daemon, stage_pids: list[int], restarts: int) -> list[int]:
    """Kill the tail stage; the new ring's stage pids once it serves again."""
    os.kill(stage_pids[-1], signal.SIGKILL)
    stats = wait_serving_again(daemon.runtime_dir, daemon.stages, restarts=restarts)
    assert not {s.pid for s in stats.stages} & set(stage_pids)
    return [s.pid for s in stats.stages]


def workers_of(launcher: int, zygote: int) -> list[str]:
    """The names of the launcher's children but its zygote."""
    return sorted(comm(pid) for pid in children_of(launcher) if pid != zygote)


def test_workers_come_from_the_zygote_and_without_it_from_fresh_interpreters(tiny_models, start_daemon):
    model = tiny_models["llama-tokenizer"]  # the bridge and the front load its tokenizer
    front = {"listen": f"127.0.0.1:{free_port()}"}
    daemon = start_daemon(model, [(0, 3), (3, 6)], name="forked", http=front).wait_ready()
    launcher, reference = daemon.process.pid, reference_model(model)
    stages = daemon.child_pids()
    assert set(stages) <= set(children_of(launcher)) and [comm(pid) for pid in stages] == ["stage-0", "stage-1"]
    zygote = zygote_of(launcher)
    assert workers_of(launcher, zygote) == ["bridge", "front-0", "stage-0", "stage-1"]  # each forked, named for it
    wanted = worker_env(os.environ)  # kvasird ran itself again in it, so its forks have it from their start
    for pid in (launcher, zygote, *stages):
        assert {key: environ(pid).get(key) for key in SETTINGS} == {key: wanted.get(key) for key in SETTINGS}

    stages = restarted(daemon, stages, 1)  # forked again
    assert set(stages) <= set(children_of(launcher)) and [comm(pid) for pid in stages] == ["stage-0", "stage-1"]
    assert one_greedy(daemon.runtime_dir, [1, 2, 3], 5) == hf_greedy(reference, [1, 2, 3], 5)

    os.kill(zygote, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while not exited(zygote) and time.monotonic() < deadline:
        time.sleep(0.05)
    stages = restarted(daemon, stages, 2)  # the zygote is gone: fresh interpreters (the bridge too)
    assert all("kvasir.daemon.worker" in cmdline(pid) for pid in stages), [cmdline(pid) for pid in stages]
    assert workers_of(launcher, zygote) == ["bridge", "front-0", "python", "python"]  # the bridge and front served on
    assert "the zygote is gone" in daemon.log()
    assert one_greedy(daemon.runtime_dir, [1, 2, 3], 5) == hf_greedy(reference, [1, 2, 3], 5)
