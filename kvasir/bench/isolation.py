"""``kvasir bench isolation``: in a fleet, a stage of one instance is killed under a steady
load; what the others keep serving.

A closed loop keeps ``concurrency`` requests in flight throughout (each worker sends the
next job as soon as its request ends, cycling through the jobs). Once tokens flow, the
first instance's tail is killed (SIGKILL, from this process: the daemon runs on this
host) and the instance's restart is watched until it serves again; the loop runs on as
long again, then stops taking new jobs. Reported: output tokens/s over the same span
before the kill, during the restart and after it (all instances together), how long the
restart took, and how the requests ended on each instance.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

from kvasir.bench.metrics import RequestRecord
from kvasir.bench.runner import one_request
from kvasir.bench.workload import Job
from kvasir.client import AsyncClient
from kvasir.errors import KvasirError
from kvasir.wire.client import DaemonStats

FLOWING_TOKENS = 48  # output tokens per request in flight before the kill: the loop is steady by then
RESTART_TIMEOUT_S = 600.0


async def run_isolation(client: AsyncClient, jobs: list[Job], concurrency: int, say) -> dict:
    stats = await client.stats()
    if len(stats.instances) < 2 or stats.state != "serving":
        raise KvasirError(
            f"isolation needs a serving fleet of two or more instances (this daemon has {len(stats.instances)})"
        )
    victim = stats.instances[0]
    stage = next(s for s in stats.stages if s.index == victim.stages[-1])
    loop = _Loop(client, jobs)
    started = time.perf_counter()
    load = asyncio.gather(*(loop.worker(k) for k in range(concurrency)))
    await _flowing(client, stats, concurrency * FLOWING_TOKENS, load)
    say(f"killing stage {stage.index} (pid {stage.pid}) of instance {victim.name} under {concurrency} requests")
    killed = time.perf_counter()
    os.kill(stage.pid, signal.SIGKILL)
    back = await _back(client, victim.name, victim.restarts, load)
    restart = back - killed
    say(f"instance {victim.name} serves again after {restart:.1f} s; loading on for as long again")
    await asyncio.sleep(restart)
    loop.stop = True
    await load
    span = min(restart, killed - started)
    rate = {
        name: _tokens_between(loop.records, start, start + span) / span if span > 0 else 0.0
        for name, start in (("before", killed - span), ("during", killed), ("after", back))
    }
    return {
        "victim": {"instance": victim.name, "stage": stage.index},
        "restart_s": restart,
        "tokens_per_s_before": rate["before"],
        "tokens_per_s_during": rate["during"],
        "tokens_per_s_after": rate["after"],
        "during_over_before": rate["during"] / rate["before"] if rate["before"] > 0 else 0.0,
        "finished": _finished(loop.records),
        "failed": sum(1 for r in loop.records if not r.ok),
    }


class _Loop:
    """A closed loop that runs until told to stop: each worker sends the next job as soon as
    its request ends."""

    def __init__(self, client: AsyncClient, jobs: list[Job]) -> None:
        if not jobs:
            raise KvasirError("isolation needs at least one job")
        self.client, self.jobs = client, jobs
        self.records: list[RequestRecord] = []
        self.stop = False
        self._next = 0

    async def worker(self, k: int) -> None:
        while not self.stop:
            job = self.jobs[self._next % len(self.jobs)]
            self._next += 1
            self.records.append(await one_request(self.client, job, ignore_eos=True))


async def _flowing(client: AsyncClient, start: DaemonStats, tokens: int, load: asyncio.Future) -> None:
    while (await client.stats()).tokens_out - start.tokens_out < tokens:
        if load.done():
            raise KvasirError("the load ended before tokens flowed")
        await asyncio.sleep(0.1)


async def _back(client: AsyncClient, name: str, restarts: int, load: asyncio.Future) -> float:
    deadline = time.monotonic() + RESTART_TIMEOUT_S
    while time.monotonic() < deadline:
        state = next(i for i in (await client.stats()).instances if i.name == name)
        if state.state == "serving" and state.restarts > restarts:
            return time.perf_counter()
        if load.done():
            raise KvasirError("the load ended before the instance was back")
        await asyncio.sleep(0.1)
    raise KvasirError(f"instance {name} was not serving again {RESTART_TIMEOUT_S:.0f} s after the kill")


def _tokens_between(records: list[RequestRecord], start: float, end: float) -> int:
    """Output tokens that arrived within [start, end) on the bench's clock."""
    return sum(1 for r in records for t in r.token_times_s if start <= r.submitted + t < end)


def _finished(records: list[RequestRecord]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in records:
        if r.ok:
            out[r.instance] = out.get(r.instance, 0) + 1
    return out


def print_isolation(report: dict, echo) -> None:
    v = report["victim"]
    echo(f"killed stage {v['stage']} of instance {v['instance']}; it served again after {report['restart_s']:.1f} s")
    echo(
        f"output tokens/s before {report['tokens_per_s_before']:.1f}, during the restart "
        f"{report['tokens_per_s_during']:.1f} ({report['during_over_before']:.2f}x), after {report['tokens_per_s_after']:.1f}"
    )
    finished = ", ".join(f"{n} on {name}" for name, n in sorted(report["finished"].items()))
    echo(f"finished: {finished}; failed: {report['failed']}")
