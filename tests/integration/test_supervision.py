"""Supervision: a stage dies or hangs under load; every request is told once, the ring
restarts and serves again, and nothing leaks after the final shutdown."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

from kvasir.client import AsyncClient, Client, NoDaemon
from kvasir.wire.client import Cancelled, ErrorEvent, Finished
from tests.support.daemon import BIN, alive
from tests.support.models import hf_greedy, reference_model
from tests.support.procs import bridge_of

TERMINAL = (Finished, Cancelled, ErrorEvent)


async def load_then(daemon, count: int, strike, max_tokens: int = 200):
    """Submit ``count`` requests, call ``strike()`` once tokens flow, collect every event.

    Returns the events per request, when the strike happened, when the last terminal
    event arrived, and the answer to a submission made right after the strike's errors."""
    async with await AsyncClient.connect(daemon.runtime_dir) as client:
        streams = [
            await client.submit(token_ids=[3 + i % 50, 7, 9, 11], max_tokens=max_tokens, temperature=0, ignore_eos=True)
            for i in range(count)
        ]
        events: dict[int, list] = {i: [] for i in range(count)}
        ended: dict[int, float] = {}

        async def collect(i, stream):
            async for event in stream:
                events[i].append(event)
            ended[i] = time.monotonic()

        tasks = [asyncio.create_task(collect(i, s)) for i, s in enumerate(streams)]
        while sum(len(evs) for evs in events.values()) < count + 20:  # accepted, and tokens flowing
            await asyncio.sleep(0.02)
        struck = time.monotonic()
        strike()
        await asyncio.wait_for(asyncio.gather(*tasks), 60)
        late = await asyncio.wait_for(
            (await client.submit(token_ids=[1, 2], max_tokens=2, temperature=0)).result(), 120
        )
        return events, struck, max(ended.values()), late


def terminal_codes(events: dict[int, list]) -> list[str]:
    codes = []
    for evs in events.values():
        terminal = [e for e in evs if isinstance(e, TERMINAL)]
        assert len(terminal) == 1 and evs[-1] is terminal[0], evs[-3:]
        codes.append(terminal[0].code if isinstance(terminal[0], ErrorEvent) else "finished")
    return codes


def wait_serving_again(runtime_dir: Path, stages: int, timeout_s: float = 120.0, restarts: int = 1):
    """The daemon's stats once it serves again after ``restarts`` restarts, every stage reporting."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with Client(runtime_dir) as client:
                stats = client.stats()
        except NoDaemon:  # the bridge is being restarted: no client.sock yet
            stats = None
        if (
            stats is not None
            and stats.restarts == restarts
            and stats.state == "serving"
            and len(stats.stages) == stages
        ):
            return stats
        time.sleep(0.1)
    raise AssertionError("the daemon did not serve again")


def one_greedy(runtime_dir: Path, ids: list[int], n: int) -> list[int]:
    with Client(runtime_dir) as client:
        final = client.generate(token_ids=ids, max_tokens=n, temperature=0)
    assert isinstance(final, Finished), final
    return final.token_ids


def cached(runtime_dir: Path, ids: list[int]) -> int:
    """How many of the prompt's tokens a request found in the prefix cache."""
    with Client(runtime_dir) as client:
        final = client.generate(token_ids=ids, max_tokens=2, temperature=0)
    assert isinstance(final, Finished), final
    return final.usage.cached_tokens


def test_chaos_sigkill_a_random_stage_under_load(tiny_models, start_daemon):
    daemon = start_daemon(tiny_models["llama"], [(0, 2), (2, 4), (4, 6)], name="chaos").wait_ready()
    launcher = daemon.process.pid
    known = [21, 5, 8, 13, 2, 34, 55, 9, 3]  # two full blocks the prefix cache keeps
    assert [cached(daemon.runtime_dir, known) for _ in range(2)] == [0, 8]
    before = daemon.child_pids()
    victim_index = random.randrange(3)
    victim = before[victim_index]
    print(f"killing stage {victim_index} (pid {victim})")
    events, struck, told, late = asyncio.run(load_then(daemon, 50, lambda: os.kill(victim, signal.SIGKILL)))
    codes = terminal_codes(events)
    assert set(codes) <= {"finished", "stage_failed"} and "stage_failed" in codes, codes
    failure = next(e for evs in events.values() for e in evs if isinstance(e, ErrorEvent))
    assert f"stage-{victim_index}" in failure.message and "signal 9" in failure.message, failure.message
    assert told - struck < 2.0, f"clients were told {told - struck:.2f} s after the failure"
    assert isinstance(late, ErrorEvent) and late.code == "restarting", late
    stats = wait_serving_again(daemon.runtime_dir, daemon.stages)
    back = time.monotonic()
    print(f"failure -> every client told: {told - struck:.2f} s; failure -> serving again: {back - struck:.2f} s")
    assert stats.restarts == 1 and f"stage-{victim_index}" in stats.last_failure
    assert not any(alive(pid) for pid in before)  # the old ring is gone, all of it
    after = [s.pid for s in stats.stages]
    assert len(after) == 3 and not set(after) & set(before)
    reference = reference_model(tiny_models["llama"])
    assert one_greedy(daemon.runtime_dir, [4, 8, 15, 16], 12) == hf_greedy(reference, [4, 8, 15, 16], 12)
    assert [cached(daemon.runtime_dir, known) for _ in range(2)] == [0, 8]  # the restart emptied the cache
    assert one_greedy(daemon.runtime_dir, known, 6) == hf_greedy(reference, known, 6)
    assert daemon.stop() == 0
    assert not any(alive(pid) for pid in after)
    assert list(daemon.runtime_dir.glob("*")) == []  # no socket file, no lock
    assert not list(Path("/dev/shm").glob(f"kvasir-{launcher}-*"))


def test_a_hung_stage_is_found_by_heartbeat_and_replaced(tiny_models, start_daemon):
    daemon = start_daemon(tiny_models["llama"], [(0, 3), (3, 6)], name="hung", heartbeat_timeout_s=2.0).wait_ready()
    before = daemon.child_pids()
    events, struck, told, late = asyncio.run(load_then(daemon, 8, lambda: os.kill(before[1], signal.SIGSTOP)))
    codes = terminal_codes(events)
    assert "stage_failed" in codes and set(codes) <= {"finished", "stage_failed"}
    failure = next(e for evs in events.values() for e in evs if isinstance(e, ErrorEvent))
    assert "stage-1" in failure.message and "hung" in failure.message, failure.message
    stats = wait_serving_again(daemon.runtime_dir, daemon.stages)
    assert stats.restarts == 1 and "no heartbeat" in stats.last_failure
    shown = subprocess.run(
        [str(BIN / "kvasir"), "stats", "--runtime-dir", str(daemon.runtime_dir)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0 and "serving," in shown.stdout and "restarts 1" in shown.stdout
    assert "last failure" in shown.stdout and "stage-1" in shown.stdout and "hung" in shown.stdout
    body = json.loads(
        subprocess.run(
            [str(BIN / "kvasir"), "stats", "--json", "--runtime-dir", str(daemon.runtime_dir)],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
    )
    assert body["restarts"] == 1 and body["state"] == "serving" and body["last_failure_age_s"] >= 0
    assert not alive(before[1])  # the hung process was killed, not left stopped
    reference = reference_model(tiny_models["llama"])
    assert one_greedy(daemon.runtime_dir, [9, 9, 2], 6) == hf_greedy(reference, [9, 9, 2], 6)


def test_the_bridge_is_restarted_with_the_ring(tiny_models, start_daemon):
    daemon = start_daemon(tiny_models["llama"], [(0, 3), (3, 6)], name="bridge").wait_ready()

    stage_pids = set(daemon.child_pids())
    bridge = bridge_of(daemon.process.pid, stage_pids)
    events, struck, told, late = asyncio.run(load_then(daemon, 4, lambda: os.kill(bridge, signal.SIGKILL)))
    codes = terminal_codes(events)  # the client library tells its own requests: the bridge is gone
    assert "stage_failed" in codes and set(codes) <= {"finished", "stage_failed"}
    assert told - struck < 2.0
    # the same client's connection comes back by itself: a request sent while the bridge
    # restarted is served by the new one
    assert isinstance(late, Finished), late
    stats = wait_serving_again(daemon.runtime_dir, daemon.stages)
    assert "bridge" in stats.last_failure and not alive(bridge) and not {s.pid for s in stats.stages} & stage_pids
    reference = reference_model(tiny_models["llama"])
    assert late.token_ids == hf_greedy(reference, [1, 2], 2)
    assert one_greedy(daemon.runtime_dir, [1, 2, 3], 5) == hf_greedy(reference, [1, 2, 3], 5)


def test_restarts_are_bounded(tiny_models, start_daemon):
    daemon = start_daemon(tiny_models["llama"], [(0, 3), (3, 6)], name="bounded", max_restarts=1).wait_ready()
    launcher = daemon.process.pid
    os.kill(daemon.child_pids()[0], signal.SIGKILL)
    wait_serving_again(daemon.runtime_dir, daemon.stages)
    os.kill(daemon.child_pids()[1], signal.SIGKILL)  # the second failure in the window: give up
    assert daemon.process.wait(60) == 1
    log = daemon.log()
    assert "giving up" in log
    assert list(daemon.runtime_dir.glob("*")) == []
    assert not list(Path("/dev/shm").glob(f"kvasir-{launcher}-*"))


@pytest.mark.parametrize("victim", ["bridge", "stage"])
def test_sigterm_while_the_ring_restarts_stops_cleanly(tiny_models, start_daemon, victim):
    """SIGTERM right after a failure is noticed (the signal lands while the launcher is
    still handling it): the daemon stops at once with exit 0, nothing to drain."""
    daemon = start_daemon(tiny_models["llama"], [(0, 3), (3, 6)], name=f"{victim}-term").wait_ready()

    launcher = daemon.process.pid
    stage_pids = daemon.child_pids()
    bridge = bridge_of(launcher, stage_pids)
    os.kill(bridge if victim == "bridge" else stage_pids[-1], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while "child failed" not in daemon.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    daemon.process.send_signal(signal.SIGTERM)  # the new ring is still loading
    assert daemon.process.wait(60) == 0, daemon.log()[-2000:]
    assert "nothing to drain" in daemon.log()
    assert list(daemon.runtime_dir.glob("*")) == []
    assert not list(Path("/dev/shm").glob(f"kvasir-{launcher}-*"))
