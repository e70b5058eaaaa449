"""Shutdown under load, clean-up, and two daemons side by side."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from pathlib import Path

from kvasir.client import AsyncClient
from kvasir.wire.client import Cancelled, ErrorEvent, Finished, TokenOut
from tests.support.daemon import BIN, alive, exited, wait_serving, write_plan
from tests.support.models import hf_greedy, reference_model
from tests.support.procs import children_of

TERMINAL = (Finished, Cancelled, ErrorEvent)


async def load_then_sigterm(daemon, count):
    async with await AsyncClient.connect(daemon.runtime_dir) as client:
        streams = [
            await client.submit(token_ids=[3 + i, 7, 9, 11], max_tokens=200, temperature=0) for i in range(count)
        ]
        events = {i: [] for i in range(count)}

        async def collect(i, stream):
            async for event in stream:
                events[i].append(event)

        tasks = [asyncio.create_task(collect(i, s)) for i, s in enumerate(streams)]
        while not any(isinstance(e, TokenOut) for evs in events.values() for e in evs):
            await asyncio.sleep(0.05)
        daemon.process.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.5)  # the launcher has told the bridge to drain
        late = await (await client.submit(token_ids=[1, 2], max_tokens=2, temperature=0)).result()
        await asyncio.wait_for(asyncio.gather(*tasks), 60)
        return events, late


def test_sigterm_under_load_ends_every_request_once_and_leaves_nothing(tiny_models, start_daemon):
    target = start_daemon(tiny_models["llama"], [(0, 2), (2, 4), (4, 6)], name="a", drain_timeout=1.0)
    other = start_daemon(tiny_models["llama"], [(0, 3), (3, 6)], name="b")  # side by side, own runtime dir
    target.wait_ready()
    other.wait_ready()
    pids = target.child_pids()
    launcher_pid = target.process.pid
    events, late = asyncio.run(load_then_sigterm(target, 16))
    assert isinstance(late, ErrorEvent) and late.code == "shutting_down"
    codes = []
    for evs in events.values():
        terminal = [e for e in evs if isinstance(e, TERMINAL)]
        assert len(terminal) == 1 and evs[-1] is terminal[0], evs[-3:]
        codes.append(terminal[0].code if isinstance(terminal[0], ErrorEvent) else "finished")
    assert set(codes) <= {"finished", "shutting_down"}
    assert "shutting_down" in codes  # the 1 s drain cannot finish 16 x 200 tokens
    assert target.process.wait(60) == 0
    assert not any(alive(pid) for pid in pids)
    assert list(target.runtime_dir.glob("*")) == []  # sockets and lock removed
    assert not list(Path("/dev/shm").glob(f"kvasir-{launcher_pid}-*"))
    # the other daemon never noticed
    final = asyncio.run(one_request(other.runtime_dir))
    assert final.token_ids == hf_greedy(reference_model(tiny_models["llama"]), [4, 8, 15], 5)


async def one_request(runtime_dir):
    async with await AsyncClient.connect(runtime_dir) as client:
        return await (await client.submit(token_ids=[4, 8, 15], max_tokens=5, temperature=0)).result()


def test_children_exit_when_the_launcher_is_killed(tiny_models, start_daemon):
    daemon = start_daemon(tiny_models["llama"], [(0, 3), (3, 6)], name="orphans").wait_ready()
    launcher = daemon.process.pid
    children = children_of(launcher)
    assert len(children) == 4  # two stages, the bridge and the zygote
    daemon.process.send_signal(signal.SIGKILL)
    daemon.process.wait(10)
    # each notices within a second (a loaded machine may take longer); exited, not alive: an
    # orphan whose new parent has not reaped it yet is a zombie (a test process that made
    # itself a subreaper in-process, kvasir/daemon/forks.py, never reaps)
    deadline = time.monotonic() + 60
    while not all(exited(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(exited(pid) for pid in children), "children outlived their launcher"
    leftovers = sorted(Path("/dev/shm").glob(f"kvasir-{launcher}-*"))  # a killed launcher cannot clean up
    assert [p.name.rsplit("-", 1)[1] for p in leftovers] == ["edge0"]

    # the next kvasird (here on the same runtime dir, as systemd's restart would) removes
    # them; in a suite run two at a time another test's kvasird, starting meanwhile, may
    # be the next one (each sweeps every stale segment of this user: tests/unit/ring/test_slots.py)
    again = start_daemon(tiny_models["llama"], [(0, 3), (3, 6)], name="orphans").wait_ready()
    assert not any(p.exists() for p in leftovers)
    if "removed stale shared memory" in again.log():
        assert leftovers[0].name in again.log()
    assert list(Path("/dev/shm").glob(f"kvasir-{again.process.pid}-*-edge0"))


def test_stop_with_parent_drains_and_cleans_up_when_the_starter_is_killed(tiny_models, tmp_path):
    plan = write_plan(tmp_path / "p.toml", tiny_models["llama"], [(0, 3), (3, 6)])
    runtime, log = tmp_path / "rt", tmp_path / "kvasird.log"
    # a starter that is not this test, as kvasir bench is for its daemons; kvasird is its child
    starter = subprocess.Popen(
        [
            "sh",
            "-c",
            f'"{BIN}/kvasird" start --plan "{plan}" --runtime-dir "{runtime}" --stop-with-parent > "{log}" 2>&1 & wait',
        ]
    )
    launcher = None
    try:
        wait_serving(starter, runtime, 2, 180, lambda: log.read_text(errors="replace"))
        launcher = int((runtime / "kvasird.lock").read_text())
        children = children_of(launcher)
        assert len(children) == 4 and list(Path("/dev/shm").glob(f"kvasir-{launcher}-*"))
        starter.send_signal(signal.SIGKILL)
        starter.wait(10)
        deadline = time.monotonic() + 60
        while not all(exited(pid) for pid in [launcher, *children]) and time.monotonic() < deadline:
            time.sleep(0.1)
        text = log.read_text(errors="replace")
        assert all(exited(pid) for pid in [launcher, *children]), text
    finally:
        starter.kill()
        if launcher is not None and not exited(launcher):
            os.kill(launcher, signal.SIGKILL)  # the test failed: leave no daemon (its children follow it)
    assert "the process that started kvasird is gone" in text and "stopped" in text
    assert list(runtime.glob("*")) == []  # it drained and cleaned up as on SIGTERM
    assert not list(Path("/dev/shm").glob(f"kvasir-{launcher}-*"))
