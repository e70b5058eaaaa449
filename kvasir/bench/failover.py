"""``kvasir bench failover``: SIGKILL a stage under load and time the recovery.

Each round loads the daemon with ``concurrency`` requests, kills one stage once tokens
flow (stage 0, 1, ... in turn), and measures two things from the kill: until every
request in flight has its terminal event ("told"), and until a new one-token request
finishes ("serving again"). The kill comes from this process, so it runs on the daemon's
host only.
"""

from __future__ import annotations

import asyncio
import os
import signal
import statistics
import time

from kvasir.bench.workload import Job
from kvasir.client import AsyncClient
from kvasir.errors import KvasirError
from kvasir.wire.client import Cancelled, ErrorEvent, Finished, TokenOut


async def _serving(client: AsyncClient, restarts: int, stages: int, timeout_s: float = 600.0):
    """The daemon's stats once it serves after ``restarts`` restarts with every stage reporting."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = await client.stats()
        if stats.state == "serving" and stats.restarts == restarts and len(stats.stages) == stages:
            return stats
        await asyncio.sleep(0.1)
    raise KvasirError(f"the daemon was not serving again {timeout_s:.0f} s after a failure")


async def _round(client: AsyncClient, jobs: list[Job], victim: int) -> dict:
    streams = [
        await client.submit(j.text, token_ids=j.token_ids, max_tokens=j.max_tokens, temperature=0, ignore_eos=True)
        for j in jobs
    ]
    flowing = asyncio.Event()
    outcome: list[tuple[str, float]] = []

    async def follow(stream) -> None:
        last = None
        async for event in stream:
            if isinstance(event, TokenOut):
                flowing.set()
            last = event
        code = last.code if isinstance(last, ErrorEvent) else type(last).__name__.lower()
        outcome.append((code, time.monotonic()))

    tasks = [asyncio.create_task(follow(s)) for s in streams]
    await flowing.wait()
    killed = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    await asyncio.gather(*tasks)
    told = max(t for _, t in outcome) - killed
    while True:
        probe = await (await client.submit(token_ids=[1], max_tokens=1, temperature=0)).result()
        if isinstance(probe, Finished):
            break
        if not isinstance(probe, ErrorEvent) or probe.code != "restarting":
            raise KvasirError(f"a request after the failure ended {_how(probe)}")
        await asyncio.sleep(0.05)
    codes: dict[str, int] = {}
    for code, _ in outcome:
        codes[code] = codes.get(code, 0) + 1
    return {"told_s": told, "serving_again_s": time.monotonic() - killed, "outcomes": codes}


async def run_failover(client: AsyncClient, jobs: list[Job], concurrency: int, rounds: int, say) -> dict:
    stats = await client.stats()
    stages, restarts = len(stats.stages), stats.restarts
    if stats.state != "serving" or not stages:
        raise KvasirError(f"the daemon is {stats.state} with {stages} stages reporting: try again shortly")
    results = []
    for k in range(rounds):
        stats = await _serving(client, restarts, stages)
        index = k % stages
        say(f"round {k + 1}: killing stage {index} (pid {stats.stages[index].pid}) under {concurrency} requests")
        batch = [jobs[(k * concurrency + i) % len(jobs)] for i in range(concurrency)]
        result = await _round(client, batch, stats.stages[index].pid)
        results.append({"stage": index, **result})
        restarts += 1
    await _serving(client, restarts, stages)
    told = [r["told_s"] for r in results]
    back = [r["serving_again_s"] for r in results]
    return {
        "rounds": results,
        "told_s": {"median": statistics.median(told), "max": max(told)},
        "serving_again_s": {"median": statistics.median(back), "max": max(back)},
    }


def print_failover(report: dict, echo) -> None:
    echo("round  stage  outcomes                         told (s)  serving again (s)")
    for k, r in enumerate(report["rounds"], 1):
        outcomes = ", ".join(f"{n} {code}" for code, n in sorted(r["outcomes"].items()))
        echo(f"{k:<5}  {r['stage']:<5}  {outcomes:<31}  {r['told_s']:8.3f}  {r['serving_again_s']:17.2f}")
    t, b = report["told_s"], report["serving_again_s"]
    echo(f"failure -> every client told: median {t['median']:.3f} s, max {t['max']:.3f} s")
    echo(f"failure -> serving again:     median {b['median']:.2f} s, max {b['max']:.2f} s")


def _how(event: Cancelled | ErrorEvent) -> str:
    return f"{event.code}: {event.message}" if isinstance(event, ErrorEvent) else "cancelled"
