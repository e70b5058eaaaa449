"""``kvasir bench plans A B``: two plans of one model side by side.

Typically a colocated plan against a disaggregated one. Both get the same jobs (exact
output lengths: EOS ignored) on the same cores, one daemon at a time, alternating when
there are several rounds. Reported per plan: throughput, TTFT and ITL percentiles, SLO
attainment (and goodput with a rate sweep), each stage's and pool's busy / starved /
blocked, and what the KV hand-off cost (disaggregated plans).
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec

from kvasir.bench.daemon import ManagedDaemon
from kvasir.bench.metrics import attainment, handoff_figures, search_goodput
from kvasir.bench.options import Slo
from kvasir.bench.runner import LoadResult, instance_figures, run_load, stage_fractions, summary_data
from kvasir.bench.workload import Load
from kvasir.client import AsyncClient
from kvasir.config.plan import plan_toml
from kvasir.errors import KvasirError
from kvasir.wire.shares import PARTS, Shares, by_pool


@dataclass(frozen=True)
class PlanRun:
    name: str
    path: Path  # the plan as run (model source made absolute)
    stages: int
    disaggregated: bool


def prepare_plans(paths: list[Path], folder: Path) -> list[PlanRun]:
    """Resolve each plan and its model (both must serve the same model), write runnable copies."""
    from kvasir.daemon.resolve import resolve_plan
    from kvasir.model.convert import prepare

    runs: list[PlanRun] = []
    models: set[str] = set()
    for k, path in enumerate(paths):
        plan, source = resolve_plan(path)
        source = prepare(source)
        models.add(source.name)
        name = path.stem if path.stem not in {r.name for r in runs} else f"{path.stem}-{k + 1}"
        copy = folder / f"{name}.toml"
        copy.write_text(
            plan_toml(msgspec.structs.replace(plan, model=msgspec.structs.replace(plan.model, source=source.name)))
        )
        runs.append(PlanRun(name, copy, len(plan.all_stages), plan.disaggregated))
    if len(models) != 1:
        raise KvasirError(f"the plans serve different models ({', '.join(sorted(models))}): compare plans of one model")
    return runs


async def _drive(runtime_dir: Path, load: Load, rate: float | None = None) -> LoadResult:
    async with await AsyncClient.connect(runtime_dir) as client:
        if rate is not None:
            return await run_load(client, load.jobs, warmup=load.warmup, rate=rate, seed=load.seed, ignore_eos=True)
        return await run_load(
            client,
            load.jobs,
            warmup=load.warmup,
            concurrency=load.concurrency,
            rate=load.rate,
            seed=load.seed,
            ignore_eos=True,
        )


def _figures(results: list[LoadResult], slo) -> dict:
    records = [r for result in results for r in result.records]
    summary = summary_data(records, sum(result.duration_s for result in results), slo)
    last = results[-1]
    stages = stage_fractions(last.stats_before, last.stats_after)
    instances = instance_figures(records, sum(result.duration_s for result in results))
    return {
        "summary": summary,
        "stages": stages,
        "pools": pool_fractions(stages),
        "handoff": handoff_figures(records),
        **({"instances": instances} if len(instances) > 1 else {}),
    }


def pool_fractions(stages: list[dict]) -> dict:
    """Busy / starved / blocked per pool ("ring" for a colocated plan) from stage_fractions():
    its stages' seconds summed, so weighted by seconds (kvasir/wire/shares.py)."""
    pools = by_pool((stage["pool"] or "ring", _window_shares(stage)) for stage in stages)
    return {name: {part: shares.fraction(part) for part in PARTS} for name, shares in pools.items()}


def _window_shares(stage: dict) -> Shares:
    wall = stage["window_s"]
    return Shares(wall, stage["busy"] * wall, stage["starved"] * wall, stage["blocked"] * wall)


def run_plans(
    paths: list[Path],
    load: Load,
    *,
    rounds: int = 1,
    slo: Slo | None = None,
    sweep: tuple[float, int] | None = None,
    say: Callable[[str], None] = lambda line: None,
) -> dict:
    """Run the load on each plan (``rounds`` times, alternating), or search each plan's
    goodput (``sweep`` = (first rate, bisection steps); needs ``slo``)."""
    entries: dict[str, dict] = {}
    targets = slo.targets if slo is not None else None
    with tempfile.TemporaryDirectory(prefix="kvasir-plans-") as tmp:
        runs = prepare_plans(paths, Path(tmp))
        results: dict[str, list[LoadResult]] = {run.name: [] for run in runs}
        if sweep is None:
            for round_index in range(rounds):
                for run in runs:
                    say(f"round {round_index + 1}/{rounds}: {run.name}")
                    with ManagedDaemon(run.path, Path(tmp) / run.name, run.stages) as daemon:
                        results[run.name].append(asyncio.run(_drive(daemon.runtime_dir, load)))
                    say(f"  {_tokens_per_s(results[run.name][-1]):.1f} output tokens/s")
            for run in runs:
                entries[run.name] = {"disaggregated": run.disaggregated, **_figures(results[run.name], targets)}
        elif slo is None:
            raise KvasirError("a goodput sweep needs latency targets (an SLO)")
        else:
            for run in runs:
                entries[run.name] = {
                    "disaggregated": run.disaggregated,
                    **_sweep(run, load, slo, sweep, Path(tmp), say),
                }
    return {"plans": [str(p) for p in paths], "rounds": rounds, "contenders": entries, "ratios": _ratios(entries)}


def _sweep(run: PlanRun, load: Load, slo: Slo, sweep: tuple[float, int], folder: Path, say) -> dict:
    start, steps = sweep
    points: dict[float, LoadResult] = {}
    with ManagedDaemon(run.path, folder / run.name, run.stages) as daemon:

        def measure(rate: float) -> float:
            say(f"{run.name}: rate {rate:.3g} requests/s")
            points[rate] = asyncio.run(_drive(daemon.runtime_dir, load, rate))
            return attainment(points[rate].records, *slo.targets)

        best, measured = search_goodput(measure, slo.attain, start, steps)
    shown = max((rate for rate in points if rate <= best), default=min(points))
    figures = _figures([points[shown]], slo.targets)
    return {
        **figures,
        "goodput": best,
        "shown_rate": shown,
        "sweep": [{"rate": r, "attainment": a} for r, a in measured],
    }


def _tokens_per_s(result: LoadResult) -> float:
    done = [r for r in result.records if r.ok]
    return sum(r.output_tokens for r in done) / result.duration_s if result.duration_s > 0 else 0.0


def _ratios(entries: dict[str, dict]) -> dict:
    """Second plan over first: throughput, latency percentiles, goodput (when swept)."""
    if len(entries) != 2:
        return {}
    (a, first), (b, second) = entries.items()
    ratios = {}
    fa, fb = first["summary"], second["summary"]
    if fa["output_tokens_per_s"] > 0:
        ratios[f"{b}/{a} output tokens/s"] = fb["output_tokens_per_s"] / fa["output_tokens_per_s"]
    for name in ("ttft", "itl"):
        for q in ("p50", "p99"):
            if fa[name][q] > 0:
                ratios[f"{b}/{a} {name} {q}"] = fb[name][q] / fa[name][q]
    if "goodput" in first and first["goodput"] > 0:
        ratios[f"{b}/{a} goodput"] = second["goodput"] / first["goodput"]
    return ratios
