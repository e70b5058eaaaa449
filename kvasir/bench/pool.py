"""``kvasir bench pool``: what the KV pool saves a request whose prefix was evicted.

From one plan with ``[kv_pool]``, three daemons in turn: the pool off, host memory only,
disk only (a fresh folder). In each, per round, a fresh prompt of ``prompt_len`` tokens
is computed (cold), pushed out of the instance's cache by filler prompts of more tokens
than the cache holds, and asked again: the daemon with the pool reads its prefix back,
the one without computes it again. Each ratio is the second time to first token over
the first, in the same daemon, so the machine's noise between daemons cancels. The disk
daemon is then restarted and every round's prompt asked once more: read back from disk
after a restart, against the same prompt's cold start.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

import msgspec

from kvasir.bench.daemon import ManagedDaemon
from kvasir.client import AsyncClient
from kvasir.config.kvpool import KvPoolSpec
from kvasir.config.plan import Plan, plan_toml
from kvasir.errors import KvasirError
from kvasir.wire.client import Finished

VARIANTS = ("off", "host", "disk")
FILLERS_IN_FLIGHT = 2


def variants(plan: Plan, folder: Path) -> dict[str, Path]:
    """The plan as run three ways: no pool, host memory only, disk only (under ``folder``)."""
    pool = plan.kv_pool
    if pool is None or len(plan.rings()) != 1:
        raise KvasirError("kvasir bench pool takes a plan with [kv_pool] and one instance")
    size = max(pool.host_bytes, pool.disk_bytes)
    specs = {
        "off": None,
        "host": KvPoolSpec(host_bytes=size, load_timeout_s=pool.load_timeout_s),
        "disk": KvPoolSpec(disk_dir=str(folder / "disk"), disk_bytes=size, load_timeout_s=pool.load_timeout_s),
    }
    paths = {}
    for name, spec in specs.items():
        paths[name] = folder / f"{name}.toml"
        paths[name].write_text(plan_toml(msgspec.structs.replace(plan, kv_pool=spec)))
    return paths


def prompts(vocab: int, plan: Plan, prompt_len: int, rounds: int, seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """Each round's prompt, and filler prompts holding more tokens than the instance's cache."""
    if not 0 < prompt_len < plan.model.max_seq_len:
        raise KvasirError(f"--prompt-len must be below the plan's model.max_seq_len ({plan.model.max_seq_len})")
    draw = random.Random(seed)
    capacity = plan.kv.num_blocks * plan.kv.block_size
    filler_len = plan.model.max_seq_len - 1
    fillers = [[draw.randrange(vocab) for _ in range(filler_len)] for _ in range(capacity // filler_len + 2)]
    return [[draw.randrange(vocab) for _ in range(prompt_len)] for _ in range(rounds)], fillers


async def _first_token(client: AsyncClient, prompt: list[int]) -> Finished:
    stream = await client.submit(token_ids=prompt, max_tokens=1, temperature=0, ignore_eos=True)
    end = [event async for event in stream][-1]
    if not isinstance(end, Finished):
        raise KvasirError(f"a measured request did not finish: {end}")
    return end


async def _fill(client: AsyncClient, fillers: list[list[int]]) -> None:
    for start in range(0, len(fillers), FILLERS_IN_FLIGHT):
        await asyncio.gather(*(_first_token(client, p) for p in fillers[start : start + FILLERS_IN_FLIGHT]))


def _sample(end: Finished) -> dict:
    u = end.usage
    return {
        "ttft_s": end.timings.first_token_s,
        "cached_tokens": u.cached_tokens,
        "host_tokens": u.cached_host_tokens,
        "disk_tokens": u.cached_disk_tokens,
    }


async def _rounds(runtime_dir: Path, rounds: list[list[int]], fillers: list[list[int]], say) -> tuple[list, dict]:
    """Per round: cold, then again after the fillers evicted it; and the pool's figures."""
    out = []
    async with await AsyncClient.connect(runtime_dir) as client:
        for k, prompt in enumerate(rounds):
            cold = await _first_token(client, prompt)
            await _fill(client, fillers)
            await asyncio.sleep(1.0)  # the stages' writes and their word to the bridge's index
            again = await _first_token(client, prompt)
            out.append({"cold": _sample(cold), "evicted": _sample(again)})
            say(
                f"  round {k + 1}: cold {cold.timings.first_token_s:.3f} s, evicted {again.timings.first_token_s:.3f} s"
            )
        stats = await client.stats()
    pool = stats.kv_pool
    return out, {"load_gib_s": pool.load_gib_s, "unusable": pool.unusable} if pool is not None else {}


async def _after_restart(runtime_dir: Path, rounds: list[list[int]]) -> list[dict]:
    async with await AsyncClient.connect(runtime_dir) as client:
        return [_sample(await _first_token(client, prompt)) for prompt in rounds]


def _summary(measured: list[dict], pool: dict, restarted: list[dict] | None) -> dict:
    cold = statistics.median(run["cold"]["ttft_s"] for run in measured)
    evicted = statistics.median(run["evicted"]["ttft_s"] for run in measured)
    summary = {
        "cold_ttft_s": cold,
        "evicted_ttft_s": evicted,
        "ratio": evicted / cold if cold else 0.0,
        "evicted_cached": [run["evicted"] for run in measured],
        **pool,
    }
    if restarted:
        after = statistics.median(sample["ttft_s"] for sample in restarted)
        summary |= {"restart_ttft_s": after, "restart_ratio": after / cold if cold else 0.0, "restart": restarted}
    return summary


def run_pool(
    plan_path: Path, *, prompt_len: int, rounds: int, seed: int, say: Callable[[str], None] = lambda line: None
) -> dict:
    from kvasir.daemon.resolve import resolve_plan
    from kvasir.model.convert import prepare

    plan, source = resolve_plan(plan_path)
    source = prepare(source)
    plan = msgspec.structs.replace(plan, model=msgspec.structs.replace(plan.model, source=source.name))
    measured, fillers = prompts(source.vocab_size, plan, prompt_len, rounds, seed)
    stages = len(plan.all_stages)
    report: dict = {"plan": str(plan_path), "prompt_len": prompt_len, "rounds": rounds, "variants": {}}
    with tempfile.TemporaryDirectory(prefix="kvasir-pool-") as tmp:
        for name, path in variants(plan, Path(tmp)).items():
            say(f"pool {name}")
            with ManagedDaemon(path, Path(tmp) / name, stages) as daemon:
                runs, figures = asyncio.run(_rounds(daemon.runtime_dir, measured, fillers, say))
            restarted = None
            if name == "disk":
                with ManagedDaemon(path, Path(tmp) / "restarted", stages) as daemon:
                    restarted = asyncio.run(_after_restart(daemon.runtime_dir, measured))
            report["variants"][name] = _summary(runs, figures, restarted)
    return report
