"""The modes of ``kvasir bench``, one function each (kvasir/cli/bench/ parses each
subcommand's options into these arguments and prints the report): a load run, a goodput
sweep and the submission line rate against one daemon; failover; both doors; several
plans; the comparison with transformers. Each takes the shared ``Target`` and
``Workload`` (kvasir/bench/options.py, kvasir/bench/workload.py), then its own options
by keyword, and returns the report ``--json`` prints."""

from __future__ import annotations

import asyncio
import sys
from functools import partial
from pathlib import Path

from kvasir.bench.options import Slo, Target
from kvasir.bench.workload import Load, Workload


async def _vocab(client) -> int:
    return (await client.stats()).vocab_size


async def _load_run(runtime_dir: Path, workload: Workload, load: dict, timeline: bool):
    """One load run: (its result, the stages' timelines when asked)."""
    from kvasir.bench.runner import run_load
    from kvasir.client import AsyncClient

    async with await AsyncClient.connect(runtime_dir) as client:
        result = await run_load(
            client,
            workload.jobs(await _vocab(client)),
            warmup=workload.warmup,
            seed=workload.seed,
            ignore_eos=workload.ignore_eos,
            progress=progress_bar(workload.count),
            **load,
        )
        spans = (await client.stats(timeline=True)).timeline if timeline else []
        return result, spans


def load_mode(target: Target, workload: Workload, *, concurrency: int | None, rate: float | None, slo, plot: bool):
    """A closed loop (``concurrency``) or an open one (``rate``): (report, pictures to plot)."""
    from kvasir.bench.plot import RunPicture
    from kvasir.bench.runner import ring_report

    load = {"concurrency": concurrency} if concurrency is not None else {"rate": rate}
    with target.daemon() as runtime_dir:
        result, spans = asyncio.run(_load_run(runtime_dir, workload, load, plot))
    report = {"mode": load, "workload": workload.report(), **ring_report(result, slo.targets if slo else None)}
    if slo is not None:
        report["slo"] = slo.report()
    return report, [RunPicture("ring", result.records, report["stages"], spans)]


def sweep_mode(target: Target, workload: Workload, *, rate: float, steps: int, slo: Slo, plot: bool):
    """Goodput: open-loop runs from ``rate``, doubling while the SLO holds, then bisecting."""
    from kvasir.bench.metrics import attainment, search_goodput
    from kvasir.bench.plot import RunPicture
    from kvasir.bench.runner import ring_report

    runs = []
    with target.daemon() as runtime_dir:

        def measure(point: float) -> float:
            target.say(f"rate {point:.3g} requests/s")
            result, spans = asyncio.run(_load_run(runtime_dir, workload, {"rate": point}, plot))
            runs.append((point, result, spans))
            return attainment(result.records, *slo.targets)

        best, _ = search_goodput(measure, slo.attain, rate, steps)
    sweep = []
    for point, result, _ in runs:
        figures = ring_report(result, slo.targets)
        sweep.append({"rate": point, "attainment": figures["summary"]["slo_attainment"], **figures})
    report: dict = {"mode": {"rate_sweep": True}, "workload": workload.report(), "slo": slo.report()}
    report |= {"goodput": best, "sweep": sweep}
    shown = max(range(len(runs)), key=lambda i: runs[i][0] if runs[i][0] <= best else -1)
    point, result, spans = runs[shown]
    return report, [RunPicture(f"{point:.3g} req/s", result.records, sweep[shown]["stages"], spans)]


def submit_mode(target: Target, count: int) -> dict:
    """Submission line rate: ``count`` one-token requests as fast as one client can."""
    from kvasir.bench.runner import submit_only
    from kvasir.client import AsyncClient

    async def submit(runtime_dir: Path):
        async with await AsyncClient.connect(runtime_dir) as client:
            return await submit_only(client, count)

    with target.daemon() as runtime_dir:
        return {"submit_only": asyncio.run(submit(runtime_dir))}


def doors_mode(target: Target, workload: Workload, door, *, concurrency: int, rounds: int) -> dict:
    """The same jobs through the ZeroMQ client and the HTTP front, alternating for ``rounds``."""
    import aiohttp

    from kvasir.bench.doors import doors_summary, http_sender, served_model
    from kvasir.bench.runner import one_request, run_load, summary_data
    from kvasir.client import AsyncClient

    async def run(runtime_dir: Path) -> list[tuple[str, dict]]:
        limits = aiohttp.TCPConnector(limit=0)  # one connection per request in flight, as aiperf's pool
        async with (
            await AsyncClient.connect(runtime_dir) as client,
            aiohttp.ClientSession(connector=limits) as session,
        ):
            model = await served_model(session, door)
            jobs = workload.jobs(await _vocab(client))
            senders = {"zeromq": partial(one_request, client, ignore_eos=workload.ignore_eos)}
            senders["http"] = http_sender(session, door, model, workload.ignore_eos)
            runs = []
            for round_ in range(rounds):
                for name, send in senders.items():
                    target.say(f"round {round_ + 1}/{rounds}: {name}")
                    result = await run_load(client, jobs, warmup=workload.warmup, concurrency=concurrency, send=send)
                    runs.append((name, summary_data(result.records, result.duration_s, None)))
            return runs

    with target.daemon() as runtime_dir:
        summary = doors_summary(asyncio.run(run(runtime_dir)))
    mode = {"doors": door.url, "concurrency": concurrency, "rounds": rounds}
    return {"mode": mode, "workload": workload.report(), "doors": summary}


def failover_mode(target: Target, workload: Workload, *, concurrency: int, rounds: int) -> dict:
    """Kill a stage under ``concurrency`` requests, ``rounds`` times; time the recovery."""
    from dataclasses import replace

    from kvasir.bench.failover import run_failover
    from kvasir.client import AsyncClient

    jobs_per_run = replace(workload, count=concurrency * rounds, warmup=0)

    async def run(runtime_dir: Path):
        async with await AsyncClient.connect(runtime_dir) as client:
            jobs = jobs_per_run.jobs(await _vocab(client))
            return await run_failover(client, jobs, concurrency, rounds, target.say)

    with target.daemon() as runtime_dir:
        return {"failover": asyncio.run(run(runtime_dir))}


def isolation_mode(target: Target, workload: Workload, *, concurrency: int) -> dict:
    """Kill one instance's tail under a steady load; what the fleet kept serving."""
    from kvasir.bench.isolation import run_isolation
    from kvasir.client import AsyncClient

    async def run(runtime_dir: Path):
        async with await AsyncClient.connect(runtime_dir) as client:
            jobs = workload.jobs(await _vocab(client))[workload.warmup :]
            return await run_isolation(client, jobs, concurrency, target.say)

    with target.daemon() as runtime_dir:
        return {"isolation": asyncio.run(run(runtime_dir)), "workload": workload.report()}


def plans_mode(paths: list[Path], workload: Workload, load: dict, *, rounds: int, slo, sweep, say) -> dict:
    """Several plans of one model on the same jobs: ``load`` is {"concurrency": N} or
    {"rate": R}; ``sweep`` = (first rate, bisection steps) searches each plan's goodput."""
    from kvasir.bench.plans import run_plans
    from kvasir.daemon.resolve import resolve_plan

    _, source = resolve_plan(paths[0])
    jobs = Load(workload.jobs(source.vocab_size), workload.warmup, seed=workload.seed, **load)
    report = run_plans(paths, jobs, rounds=rounds, slo=slo, sweep=sweep, say=say)
    report["workload"] = {**workload.report(), **load}
    del report["workload"]["ignore_eos"]  # always ignored: exact lengths on every plan
    if slo is not None:
        report["slo"] = slo.report()
    return {"plans": report}


def compare_mode(
    target: Target,
    workload: Workload,
    *,
    concurrency: int,
    contenders,
    rounds: int,
    slo,
    plot: bool,
    llama_server=None,
    door=None,
):
    """The ring against its baselines (drained ring, transformers), alternating: (report, pictures)."""
    from kvasir.bench.compare import run_compare
    from kvasir.bench.plot import RunPicture
    from kvasir.bench.runner import stage_fractions
    from kvasir.config.plan import default_plan_path
    from kvasir.daemon.resolve import resolve_plan

    path = target.plan or default_plan_path()
    _, source = resolve_plan(path)
    load = Load(workload.jobs(source.vocab_size), workload.warmup, concurrency=concurrency)
    pictures: dict[str, RunPicture] = {}

    async def keep(kind, client, result):
        if plot:
            spans = (await client.stats(timeline=True)).timeline
            fractions = stage_fractions(result.stats_before, result.stats_after)
            pictures[kind] = RunPicture(kind, result.records, fractions, spans)

    report = run_compare(
        path,
        load,
        contenders=contenders,
        rounds=rounds,
        slo=slo,
        llama_server=llama_server,
        door=door,
        on_ring_result=keep,
        say=target.say,
    )
    report["workload"].update(**workload.report())
    del report["workload"]["ignore_eos"]
    return {"compare": report}, list(pictures.values())


def progress_bar(total: int):
    """A progress callback: a bar on a terminal's stderr, nothing otherwise."""
    if not sys.stderr.isatty():
        return None

    def show(done: int) -> None:
        filled = 30 * done // max(total, 1)
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {done}/{total}")
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()

    return show
