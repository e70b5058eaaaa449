"""``kvasir bench compare``: one workload on several contenders, alternating, in one run.

Contenders: ``ring`` (the plan as written), ``drained`` (the same plan with
``batch.inflight = 1``), ``hf-static`` (transformers ``generate`` on fixed batches of
``concurrency`` requests), ``hf-continuous`` (transformers' ``generate_batch``) and
``llama.cpp`` (llama.cpp's own ``llama-server`` on the GGUF file the plan's model comes
from; kvasir/bench/llamacpp.py). Every contender gets the same jobs, the same model
weights and the same total CPU thread count (the plan's stage threads summed). Output
lengths are exact for all of them (the ring and llama.cpp ignore EOS, the transformers
baselines force ``min_new_tokens``), so tokens/s compare like for like. The rings are
driven through the ZeroMQ client, or with door ``http`` through an OpenAI HTTP front the
compare adds to their plans (loopback): the door whenever ``llama.cpp`` runs, which is
driven through its own, so both are measured through the same kind of door.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path

import msgspec

from kvasir.bench.daemon import ManagedDaemon, free_ports
from kvasir.bench.doors import DOORS, Door, http_sender, served_model
from kvasir.bench.options import Slo
from kvasir.bench.runner import LoadResult, ring_report, run_load
from kvasir.bench.workload import Job, Load
from kvasir.client import AsyncClient
from kvasir.config.http import HttpSpec
from kvasir.config.plan import Plan, plan_toml
from kvasir.errors import KvasirError

CONTENDERS = ("ring", "drained", "hf-static", "hf-continuous", "llama.cpp")
DEFAULT_CONTENDERS = ("ring", "drained", "hf-static", "hf-continuous")
RING_KINDS = ("ring", "drained")
BASELINE_KINDS = ("hf-static", "hf-continuous")


def contender_plans(plan: Plan, source_name: str, folder: Path, http: bool = False) -> dict[str, Door | None]:
    """Write the ring's and the drained ring's plans (model source made absolute) as
    ``folder/KIND.toml``; with ``http`` each gets a loopback HTTP front: its door."""
    model = msgspec.structs.replace(plan.model, source=source_name)
    ring = msgspec.structs.replace(plan, model=model)
    drained = msgspec.structs.replace(ring, batch=msgspec.structs.replace(plan.batch, inflight=1))
    doors: dict[str, Door | None] = {}
    for (name, variant), port in zip((("ring", ring), ("drained", drained)), free_ports(2), strict=True):
        doors[name] = None
        if http:
            front = HttpSpec(listen=f"127.0.0.1:{port}", allow_ignore_eos=True)
            variant = msgspec.structs.replace(variant, http=front)
            doors[name] = Door(f"http://127.0.0.1:{port}")
        (folder / f"{name}.toml").write_text(plan_toml(variant))
    return doors


async def _drive(runtime_dir: Path, load: Load, on_result: Callable | None, door: Door | None) -> LoadResult:
    import aiohttp

    async with contextlib.AsyncExitStack() as stack:
        client = await stack.enter_async_context(await AsyncClient.connect(runtime_dir))
        send = None
        if door is not None:  # one connection per request in flight, as llama.cpp's client
            session = await stack.enter_async_context(aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)))
            send = http_sender(session, door, await served_model(session, door), ignore_eos=True)
        result = await run_load(
            client, load.jobs, warmup=load.warmup, concurrency=load.concurrency, ignore_eos=True, send=send
        )
        if on_result is not None:
            await on_result(client, result)
        return result


class Baselines:
    """The transformers model, loaded once for every baseline run of a compare, in the
    plan's dtype (a GGUF's matrices dequantised: transformers reads no other way)."""

    def __init__(
        self, folder: Path, threads: int, pad_id: int, warmup: list[Job], concurrency: int, dtype: str = "float32"
    ) -> None:
        from kvasir.bench.baselines import load_reference

        self.model = load_reference(folder, threads, dtype)
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


class _Contest:
    """What one compare holds across its rounds: the plan, the model, the temp folder with
    the rings' plans, the transformers model (loaded at its first run)."""

    def __init__(
        self,
        plan_path: Path,
        load: Load,
        *,
        contenders: tuple[str, ...],
        slo,
        llama_server: str | None,
        door: str,
        tmp: Path,
    ):
        from kvasir.daemon.footprint import plan_footprint
        from kvasir.daemon.resolve import resolve_plan
        from kvasir.model.convert import prepare

        self.plan, source = resolve_plan(plan_path)
        self.source = prepare(source)
        self.load, self.slo, self.tmp = load, slo, tmp
        self.threads = sum(stage.threads for stage in self.plan.all_stages)
        self.product_bytes = {stage.index: stage.product_bytes for stage in plan_footprint(self.plan, self.source)}
        self.llama = self._llama_spec(llama_server) if "llama.cpp" in contenders else None
        self.doors = contender_plans(self.plan, self.source.name, tmp, http=door == "http")
        self.baselines: Baselines | None = None

    def _llama_spec(self, given: str | None):
        from kvasir.bench.llamacpp import ServerSpec, find_binary

        gguf = self.source.stored_gguf
        if gguf is None:
            raise KvasirError(
                f"llama.cpp serves GGUF files: the plan's model {self.source.name!r} is a folder, not a GGUF"
            )
        return ServerSpec.for_load(find_binary(given), gguf, self.threads, self.load)

    def ring(self, kind: str, on_result: Callable | None) -> dict:
        from kvasir.bench.roofline import stage_rates

        hook = partial(on_result, kind) if on_result is not None else None
        with ManagedDaemon(self.tmp / f"{kind}.toml", self.tmp / kind, len(self.plan.all_stages)) as daemon:
            result = asyncio.run(_drive(daemon.runtime_dir, self.load, hook, self.doors[kind]))
        report = ring_report(result, self.slo.targets if self.slo is not None else None)
        tail = len(self.plan.all_stages) - 1
        for stage in report["stages"]:
            stage.update(stage_rates(self.source, stage, stage["index"] == tail, self.product_bytes[stage["index"]]))
        report["door"] = "http" if self.doors[kind] is not None else "zeromq"
        return report

    def llama_cpp(self) -> dict:
        from kvasir.bench.llamacpp import run_llama_server

        if self.llama is None:
            raise KvasirError("llama.cpp was not among the contenders")
        summary = run_llama_server(
            self.llama, self.load, self.tmp / "llama-server.log", self.slo.targets if self.slo is not None else None
        )
        spec = self.llama
        served = {
            "gguf": str(spec.gguf),
            "threads": spec.threads,
            "slots": spec.slots,
            "slot_context": spec.slot_context,
        }
        return {"summary": summary, "door": "http", "served": served}

    def baseline(self, kind: str) -> tuple[int, float]:
        if self.baselines is None:
            pad = self.source.config.pad_token_id
            self.baselines = Baselines(
                self.source.require_weights(),
                self.threads,
                0 if pad is None else int(pad),
                self.load.jobs[: self.load.warmup],
                self.load.concurrency or 1,
                self.plan.model.dtype,
            )
        return self.baselines.run(kind, self.load.measured)


def run_compare(
    plan_path: Path,
    load: Load,
    *,
    contenders: tuple[str, ...] = DEFAULT_CONTENDERS,
    rounds: int = 1,
    slo: Slo | None = None,
    llama_server: str | None = None,
    door: str | None = None,
    on_ring_result: Callable | None = None,
    say: Callable[[str], None] = lambda line: None,
) -> dict:
    """Run every contender ``rounds`` times, alternating; the report with ratios.

    ``on_ring_result(kind, client, result)`` (async) is called after each ring run while
    its daemon still answers (the plot fetches stage timelines there). ``llama_server``:
    the binary for the llama.cpp contender (kvasir/bench/llamacpp.py finds one if None).
    ``door``: how the rings are driven, ``zeromq`` or ``http`` (default: ``http`` when
    llama.cpp is a contender, else ``zeromq``).
    """
    if load.concurrency is None:
        raise KvasirError("a compare runs a closed loop: give the load a concurrency")
    unknown = set(contenders) - set(CONTENDERS)
    if unknown or not contenders:
        raise KvasirError(f"contenders must be among {', '.join(CONTENDERS)}, got {', '.join(contenders) or 'none'}")
    door = door or ("http" if "llama.cpp" in contenders else "zeromq")
    if door not in DOORS:
        raise KvasirError(f"door must be one of {', '.join(DOORS)}, got {door!r}")
    if door != "http" and "llama.cpp" in contenders:
        raise KvasirError("llama.cpp is measured through its HTTP server: drive the rings through HTTP too (door http)")
    figures: dict[str, dict] = {name: {"output_tokens_per_s": [], "requests_per_s": []} for name in contenders}
    with tempfile.TemporaryDirectory(prefix="kvasir-compare-") as tmp:
        contest = _Contest(
            plan_path, load, contenders=contenders, slo=slo, llama_server=llama_server, door=door, tmp=Path(tmp)
        )
        for round_index in range(rounds):
            for kind in contenders:
                say(f"round {round_index + 1}/{rounds}: {kind}")
                _record(figures[kind], kind, contest, on_ring_result)
                say(f"  {figures[kind]['output_tokens_per_s'][-1]:.1f} output tokens/s")
    return _report(plan_path, contest, load, figures, rounds)


def _record(entry: dict, kind: str, contest: _Contest, on_ring_result: Callable | None) -> None:
    """One run of ``kind``: its throughput appended to ``entry``, its latest details kept."""
    if kind in BASELINE_KINDS:
        tokens, seconds = contest.baseline(kind)
        entry["output_tokens_per_s"].append(tokens / seconds)
        entry["requests_per_s"].append(len(contest.load.measured) / seconds)
        return
    details = contest.ring(kind, on_ring_result) if kind in RING_KINDS else contest.llama_cpp()
    entry["output_tokens_per_s"].append(details["summary"]["output_tokens_per_s"])
    entry["requests_per_s"].append(details["summary"]["requests_per_s"])
    entry.setdefault("itl_p50_s", []).append(details["summary"]["itl"]["p50"])
    entry.update(details)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _report(plan_path: Path, contest: _Contest, load: Load, figures: dict[str, dict], rounds: int) -> dict:
    for entry in figures.values():
        entry["mean_output_tokens_per_s"] = _mean(entry["output_tokens_per_s"])  # one figure a round
    ratios = {}
    if "ring" in figures:
        ring = figures["ring"]
        for other in (name for name in figures if name != "ring"):
            ratios[f"ring/{other}"] = ring["mean_output_tokens_per_s"] / figures[other]["mean_output_tokens_per_s"]
            if ring.get("itl_p50_s") and figures[other].get("itl_p50_s"):  # both streamed: latency per token
                ratios[f"ring/{other} ITL p50"] = _mean(ring["itl_p50_s"]) / _mean(figures[other]["itl_p50_s"])
    model = contest.plan.model
    return {
        "plan": str(plan_path),
        "threads": contest.threads,
        "served": {"dtype": model.dtype, "weights": model.weights},
        "workload": {"requests": len(load.measured), "warmup": load.warmup, "concurrency": load.concurrency},
        "rounds": rounds,
        "contenders": figures,
        "ratios": ratios,
    }
