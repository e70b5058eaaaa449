"""``kvasir bench isolation``: in a fleet, a stage of one instance is killed under a steady
load; what the others keep serving.

A closed loop keeps ``concurrency`` requests in flight throughout. Once tokens flow, the
first instance's tail is killed (SIGKILL, from this process: the daemon runs on this
host) and the instance's restart is watched until it serves again. Reported: output
tokens/s over the same span before the kill and during the restart (all instances
together), how long the restart took, and how the requests ended on each instance.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

from kvasir.bench.metrics import RequestRecord
from kvasir.bench.runner import run_load
from kvasir.bench.workload import Job
from kvasir.client import AsyncClient
from kvasir.errors import KvasirError
from kvasir.wire.client import DaemonStats

FLOWING_TOKENS = 4  # output tokens per request in flight before the kill: the loop is steady
RESTART_TIMEOUT_S = 600.0


async def run_isolation(client: AsyncClient, jobs: list[Job], concurrency: int, say) -> dict:
    stats = await client.stats()
    if len(stats.instances) < 2 or stats.state != "serving":
        raise KvasirError(
            f"isolation needs a serving fleet of two or more instances (this daemon has {len(stats.instances)})"
        )
    victim = stats.instances[0]
    stage = next(s for s in stats.stages if s.index == victim.stages[-1])
    started = time.perf_counter()
    load = asyncio.create_task(run_load(client, jobs, concurrency=concurrency, ignore_eos=True))
    await _flowing(client, stats, concurrency * FLOWING_TOKENS, load)
    say(f"killing stage {stage.index} (pid {stage.pid}) of instance {victim.name} under {concurrency} requests")
    killed = time.perf_counter()
    os.kill(stage.pid, signal.SIGKILL)
    back = await _back(client, victim.name, victim.restarts, load)
    say(f"instance {victim.name} serves again after {back - killed:.1f} s; finishing the load")
    result = await load
    span = min(back - killed, killed - started)
    before = _tokens_between(result.records, killed - span, killed) / span if span > 0 else 0.0
    during = _tokens_between(result.records, killed, back) / (back - killed)
    return {
        "victim": {"instance": victim.name, "stage": stage.index},
        "restart_s": back - killed,
        "tokens_per_s_before": before,
        "tokens_per_s_during": during,
        "during_over_before": during / before if before > 0 else 0.0,
        "finished": _finished(result.records),
        "failed": sum(1 for r in result.records if not r.ok),
    }


async def _flowing(client: AsyncClient, start: DaemonStats, tokens: int, load: asyncio.Task) -> None:
    while (await client.stats()).tokens_out - start.tokens_out < tokens:
        if load.done():
            raise KvasirError("the load ended before tokens flowed: give more --requests")
        await asyncio.sleep(0.1)


async def _back(client: AsyncClient, name: str, restarts: int, load: asyncio.Task) -> float:
    deadline = time.monotonic() + RESTART_TIMEOUT_S
    while time.monotonic() < deadline:
        state = next(i for i in (await client.stats()).instances if i.name == name)
        if state.state == "serving" and state.restarts > restarts:
            return time.perf_counter()
        if load.done():
            raise KvasirError("the load ended before the instance was back: give more --requests")
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
        f"{report['tokens_per_s_during']:.1f} ({report['during_over_before']:.2f}x)"
    )
    finished = ", ".join(f"{n} on {name}" for name, n in sorted(report["finished"].items()))
    echo(f"finished: {finished}; failed: {report['failed']}")
