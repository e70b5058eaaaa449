"""``kvasir bench compare``: one workload on several contenders, alternating, in one run.

Contenders: ``ring`` (the plan as written), ``drained`` (the same plan with
``batch.inflight = 1``), ``hf-static`` (transformers ``generate`` on fixed batches of
``concurrency`` requests) and ``hf-continuous`` (transformers' ``generate_batch``).
Every contender gets the same jobs, the same model weights and the same total torch
thread count (the plan's stage threads summed). Output lengths are exact for all of
them (the ring ignores EOS, the baselines force ``min_new_tokens``), so tokens/s
compare like for like.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path

import msgspec

from kvasir.bench.daemon import ManagedDaemon
from kvasir.bench.options import Slo
from kvasir.bench.runner import LoadResult, ring_report, run_load
from kvasir.bench.workload import Job, Load
from kvasir.client import AsyncClient
from kvasir.config.plan import Plan, plan_toml
from kvasir.errors import KvasirError

CONTENDERS = ("ring", "drained", "hf-static", "hf-continuous")
RING_KINDS = ("ring", "drained")


def contender_plans(plan: Plan, source_name: str, folder: Path) -> dict[str, Path]:
    """Write the ring's and the drained ring's plans (model source made absolute)."""
    model = msgspec.structs.replace(plan.model, source=source_name)
    ring = msgspec.structs.replace(plan, model=model)
    drained = msgspec.structs.replace(ring, batch=msgspec.structs.replace(plan.batch, inflight=1))
    paths = {}
    for name, variant in (("ring", ring), ("drained", drained)):
        paths[name] = folder / f"{name}.toml"
        paths[name].write_text(plan_toml(variant))
    return paths


async def _drive(runtime_dir: Path, load: Load, on_result: Callable | None) -> LoadResult:
    async with await AsyncClient.connect(runtime_dir) as client:
        result = await run_load(client, load.jobs, warmup=load.warmup, concurrency=load.concurrency, ignore_eos=True)
        if on_result is not None:
            await on_result(client, result)
        return result


class Baselines:
    """The transformers model, loaded once for every baseline run of a compare."""

    def __init__(self, folder: Path, threads: int, pad_id: int, warmup: list[Job], concurrency: int) -> None:
        from kvasir.bench.baselines import load_reference

        self.model = load_reference(folder, threads)
        self.pad_id = pad_id
        self.concurrency = concurrency
        self._warmup = warmup[:4]
        self._warmed: set[str] = set()

    def run(self, kind: str, jobs: list[Job]) -> tuple[int, float]:
        """(output tokens, seconds) of ``jobs``; the first run of a kind warms it up first."""
        from kvasir.bench.baselines import continuous, static_batches

        def once(batch: list[Job]) -> tuple[int, float]:
            if kind == "hf-static":
                return static_batches(self.model, batch, self.concurrency, self.pad_id)
            return continuous(self.model, batch)

        if kind not in self._warmed and self._warmup:
            once(self._warmup)
        self._warmed.add(kind)
        return once(jobs)


def run_compare(
    plan_path: Path,
    load: Load,
    *,
    contenders: tuple[str, ...] = CONTENDERS,
    rounds: int = 1,
    slo: Slo | None = None,
    on_ring_result: Callable | None = None,
    say: Callable[[str], None] = lambda line: None,
) -> dict:
    """Run every contender ``rounds`` times, alternating; the report with ratios.

    ``on_ring_result(kind, client, result)`` (async) is called after each ring run while
    its daemon still answers (the plot fetches stage timelines there).
    """
    from kvasir.bench.roofline import stage_rates
    from kvasir.config.devices import torch_dtype
    from kvasir.daemon.resolve import resolve_plan
    from kvasir.model.convert import prepare

    if load.concurrency is None:
        raise KvasirError("a compare runs a closed loop: give the load a concurrency")
    concurrency = load.concurrency
    unknown = set(contenders) - set(CONTENDERS)
    if unknown or not contenders:
        raise KvasirError(f"contenders must be among {', '.join(CONTENDERS)}, got {', '.join(contenders) or 'none'}")
    plan, source = resolve_plan(plan_path)
    source = prepare(source)
    folder = source.require_weights()
    threads = sum(stage.threads for stage in plan.all_stages)
    dtype_bytes = torch_dtype(plan.model.dtype).itemsize
    tail = len(plan.all_stages) - 1
    figures: dict[str, dict] = {name: {"output_tokens_per_s": [], "requests_per_s": []} for name in contenders}
    baselines = None
    with tempfile.TemporaryDirectory(prefix="kvasir-compare-") as tmp:
        plans = contender_plans(plan, source.name, Path(tmp))
        for round_index in range(rounds):
            for kind in contenders:
                say(f"round {round_index + 1}/{rounds}: {kind}")
                if kind in RING_KINDS:
                    hook = partial(on_ring_result, kind) if on_ring_result is not None else None
                    with ManagedDaemon(plans[kind], Path(tmp) / kind, len(plan.all_stages)) as daemon:
                        result = asyncio.run(_drive(daemon.runtime_dir, load, hook))
                    report = ring_report(result, slo.targets if slo is not None else None)
                    entry = figures[kind]
                    entry["output_tokens_per_s"].append(report["summary"]["output_tokens_per_s"])
                    entry["requests_per_s"].append(report["summary"]["requests_per_s"])
                    entry["summary"], entry["stages"] = report["summary"], report["stages"]
                    for stage in entry["stages"]:
                        stage.update(stage_rates(source, stage, stage["index"] == tail, dtype_bytes))
                    if "shards" in report:
                        entry["shards"] = report["shards"]
                else:
                    if baselines is None:
                        pad = source.config.pad_token_id
                        baselines = Baselines(
                            folder,
                            threads,
                            0 if pad is None else int(pad),
                            load.jobs[: load.warmup],
                            concurrency,
                        )
                    tokens, seconds = baselines.run(kind, load.measured)
                    figures[kind]["output_tokens_per_s"].append(tokens / seconds)
                    figures[kind]["requests_per_s"].append(len(load.measured) / seconds)
                say(f"  {figures[kind]['output_tokens_per_s'][-1]:.1f} output tokens/s")
    for entry in figures.values():
        entry["mean_output_tokens_per_s"] = sum(entry["output_tokens_per_s"]) / rounds
    ratios = {}
    if "ring" in figures:
        for other in contenders:
            if other != "ring":
                ratios[f"ring/{other}"] = (
                    figures["ring"]["mean_output_tokens_per_s"] / figures[other]["mean_output_tokens_per_s"]
                )
    return {
        "plan": str(plan_path),
        "threads": threads,
        "workload": {
            "requests": len(load.measured),
            "warmup": load.warmup,
            "concurrency": concurrency,
        },
        "rounds": rounds,
        "contenders": figures,
        "ratios": ratios,
    }
