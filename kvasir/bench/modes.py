"""The modes of ``kvasir bench``, one function each (the command in kvasir/cli/bench.py parses
the options and prints): a load run, goodput sweep or submission line rate against one
daemon; failover; several plans; the comparison with transformers."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import tempfile
from functools import partial
from pathlib import Path

from kvasir.bench.workload import workload_lengths
from kvasir.wire.transport import default_runtime_dir


@contextlib.contextmanager
def driven_daemon(plan_path: str | None, runtime_dir: str | None):
    """The runtime dir to drive: a daemon started from ``plan_path``, or the given one."""
    if plan_path is None:
        yield Path(runtime_dir) if runtime_dir else default_runtime_dir()
        return
    from kvasir.bench.daemon import ManagedDaemon
    from kvasir.config.plan import load_plan

    stages = len(load_plan(plan_path).all_stages)
    with tempfile.TemporaryDirectory(prefix="kvasir-bench-") as tmp:
        with ManagedDaemon(Path(plan_path), Path(tmp), stages) as daemon:
            yield daemon.runtime_dir


def jobs_for(total, lengths, prompts_file, seed, vocab_size):
    from kvasir.bench.workload import file_jobs, synthetic_jobs

    prompts, outputs = lengths
    if prompts_file:
        return file_jobs(Path(prompts_file), total, outputs, seed)
    return synthetic_jobs(total, prompts, outputs, vocab_size, seed)


def against_daemon(
    rt,
    concurrency,
    rate,
    count,
    warmup,
    lengths,
    prompts_file,
    seed,
    ignore_eos,
    slo,
    slo_attain,
    rate_sweep,
    sweep_steps,
    submit_only,
    plot_dir,
    say,
):
    """Runs against one daemon: a load run, a goodput sweep, or the submission line rate."""
    from kvasir.bench.metrics import attainment, search_goodput
    from kvasir.bench.plot import RunPicture
    from kvasir.bench.runner import ring_report, run_load
    from kvasir.bench.runner import submit_only as line_rate
    from kvasir.client import AsyncClient

    async def load(mode_concurrency, mode_rate, timeline):
        async with await AsyncClient.connect(rt) as client:
            info = await client.stats()
            jobs = jobs_for(count + warmup, lengths, prompts_file, seed, info.vocab_size)
            result = await run_load(
                client,
                jobs,
                warmup=warmup,
                concurrency=mode_concurrency,
                rate=mode_rate,
                seed=seed,
                ignore_eos=ignore_eos,
                progress=progress_bar(count, say),
            )
            spans = (await client.stats(timeline=True)).timeline if timeline else []
            return result, spans

    if submit_only:

        async def submit():
            async with await AsyncClient.connect(rt) as client:
                return await line_rate(client, count)

        return {"submit_only": asyncio.run(submit())}, []
    mode = {"concurrency": concurrency} if concurrency is not None else {"rate": rate}
    workload = {
        "requests": count,
        "warmup": warmup,
        **workload_lengths(lengths),
        "seed": seed,
        "ignore_eos": ignore_eos,
    }
    if rate_sweep:
        runs = []

        def measure(point):
            say(f"rate {point:.3g} requests/s")
            result, spans = asyncio.run(load(None, point, plot_dir is not None))
            runs.append((point, result, spans))
            return attainment(result.records, *slo)

        best, points = search_goodput(measure, slo_attain, rate or 1.0, sweep_steps)
        sweep = []
        for point, result, _ in runs:
            report = ring_report(result, slo)
            sweep.append({"rate": point, "attainment": report["summary"]["slo_attainment"], **report})
        report = {
            "mode": {"rate_sweep": True},
            "workload": workload,
            "slo": slo_body(slo, slo_attain),
            "goodput": best,
            "sweep": sweep,
        }
        shown = max(range(len(runs)), key=lambda i: runs[i][0] if runs[i][0] <= best else -1)
        point, result, spans = runs[shown]
        return report, [RunPicture(f"{point:.3g} req/s", result.records, sweep[shown]["stages"], spans)]
    result, spans = asyncio.run(load(concurrency, rate, plot_dir is not None))
    report = {"mode": mode, "workload": workload, **ring_report(result, slo)}
    if slo is not None:
        report["slo"] = slo_body(slo, slo_attain)
    return report, [RunPicture("ring", result.records, report["stages"], spans)]


def doors_mode(rt, door, concurrency: int, workload, rounds: int, say) -> dict:
    """The same jobs through the ZeroMQ client and the HTTP front, alternating for ``rounds``."""
    import aiohttp

    from kvasir.bench.doors import doors_summary, http_sender, served_model
    from kvasir.bench.runner import one_request, run_load, summary_data
    from kvasir.client import AsyncClient

    w = workload

    async def run() -> list[tuple[str, dict]]:
        limits = aiohttp.TCPConnector(limit=0)  # one connection per request in flight, as aiperf's pool
        async with await AsyncClient.connect(rt) as client, aiohttp.ClientSession(connector=limits) as session:
            model = await served_model(session, door)
            jobs = jobs_for(w.count + w.warmup, w.lengths, w.prompts_file, w.seed, (await client.stats()).vocab_size)
            senders = {"zeromq": partial(one_request, client, ignore_eos=w.ignore_eos)}
            senders["http"] = http_sender(session, door, model, w.ignore_eos)
            runs = []
            for round_ in range(rounds):
                for name, send in senders.items():
                    say(f"round {round_ + 1}/{rounds}: {name}")
                    result = await run_load(client, jobs, warmup=w.warmup, concurrency=concurrency, send=send)
                    runs.append((name, summary_data(result.records, result.duration_s, None)))
            return runs

    mode = {"doors": door.url, "concurrency": concurrency, "rounds": rounds}
    return {"mode": mode, "workload": w.report(), "doors": doors_summary(asyncio.run(run()))}


def failover_mode(plan_path, runtime_dir, concurrency, rounds, lengths, prompts_file, seed, say) -> dict:
    from kvasir.bench.failover import run_failover
    from kvasir.client import AsyncClient

    async def run(rt):
        async with await AsyncClient.connect(rt) as client:
            info = await client.stats()
            jobs = jobs_for(concurrency * rounds, lengths, prompts_file, seed, info.vocab_size)
            return await run_failover(client, jobs, concurrency, rounds, say)

    with driven_daemon(plan_path, runtime_dir) as rt:
        return {"failover": asyncio.run(run(rt))}


def plans_mode(
    paths, concurrency, rate, count, warmup, lengths, prompts_file, seed, rounds, slo, attain, sweep, say
) -> dict:
    from kvasir.bench.plans import Load, run_plans
    from kvasir.daemon.resolve import resolve_plan

    _, source = resolve_plan(paths[0])
    jobs = jobs_for(count + warmup, lengths, prompts_file, seed, source.vocab_size)
    load = Load(jobs, warmup, concurrency if sweep is None else None, rate if concurrency is None else None, seed)
    report = run_plans([Path(p) for p in paths], load, rounds, slo, attain, sweep, say)
    report["workload"] = {
        "requests": count,
        "warmup": warmup,
        **workload_lengths(lengths),
        "seed": seed,
        **({"concurrency": concurrency} if concurrency is not None else {"rate": rate}),
    }
    if slo is not None:
        report["slo"] = slo_body(slo, attain)
    return {"plans": report}


def slo_body(slo, attain) -> dict:
    return {"ttft_s": slo[0], "tpot_s": slo[1], "attain": attain}


def compare_mode(
    plan_path, concurrency, count, warmup, lengths, prompts_file, seed, contenders, rounds, slo, plot_dir, say
):
    from kvasir.bench.compare import Workload, run_compare
    from kvasir.bench.plot import RunPicture
    from kvasir.bench.runner import stage_fractions
    from kvasir.config.plan import default_plan_path
    from kvasir.daemon.resolve import resolve_plan

    path = Path(plan_path) if plan_path else default_plan_path()
    _, source = resolve_plan(path)
    jobs = jobs_for(count + warmup, lengths, prompts_file, seed, source.vocab_size)
    pictures: dict[str, RunPicture] = {}

    async def keep(kind, client, result):
        if plot_dir is not None:
            spans = (await client.stats(timeline=True)).timeline
            pictures[kind] = RunPicture(
                kind, result.records, stage_fractions(result.stats_before, result.stats_after), spans
            )

    names = tuple(name.strip() for name in contenders.split(",") if name.strip())
    report = run_compare(path, Workload(jobs, warmup, concurrency), names, rounds, slo, keep, say)
    report["workload"].update(**workload_lengths(lengths), seed=seed)
    return {"compare": report}, list(pictures.values())


def progress_bar(total: int, say):
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
