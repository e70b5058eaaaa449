"""Driving a running daemon: closed loop (fixed concurrency) or open loop (Poisson rate)."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, replace
from functools import partial

import msgspec

from kvasir.bench.metrics import RequestRecord, handoff_figures, summarise
from kvasir.bench.workload import Job, conversations
from kvasir.client import AsyncClient
from kvasir.wire.client import DaemonStats, Finished, TokenOut
from kvasir.wire.shares import imbalance, stage_shares, window
from kvasir.wire.stats import StageStats


@dataclass
class LoadResult:
    records: list[RequestRecord]  # measured requests only (warm-up excluded)
    duration_s: float  # first measured submission to last measured completion
    stats_before: DaemonStats
    stats_after: DaemonStats


async def one_request(
    client: AsyncClient, job: Job, ignore_eos: bool = False, clock=time.perf_counter
) -> RequestRecord:
    submitted = clock()
    stream = await client.submit(
        job.text,
        token_ids=job.token_ids,
        max_tokens=job.max_tokens,
        temperature=job.temperature,
        seed=job.seed,
        ignore_eos=ignore_eos,
        grammar=job.grammar,
    )
    times: list[float] = []
    ids: list[int] = []
    ok = False
    handoff = None
    usage = (0, 0)
    instance = ""
    drafts = None
    async for event in stream:
        if isinstance(event, TokenOut):
            times.append(clock() - submitted)
            ids.append(event.token_id)
        elif isinstance(event, Finished):
            ok = True
            usage = (event.usage.prompt_tokens, event.usage.cached_tokens)
            instance = event.instances[0] if event.instances else ""
            if event.handoff is not None:
                handoff = (event.handoff.kv_bytes, event.handoff.seconds, event.handoff.copy_s)
            if event.drafts is not None:
                drafts = (event.drafts.passes, event.drafts.drafted, event.drafts.accepted)
    first = times[0] if times else clock() - submitted
    return RequestRecord(
        submitted,
        first,
        tuple(times),
        len(times),
        ok,
        handoff,
        *usage,
        output_ids=tuple(ids),
        instance=instance,
        drafts=drafts,
    )


async def converse(send, conversation: list[Job]) -> list[RequestRecord]:
    """Send a conversation's turns in order: each later turn's prompt is the history (the
    turn before's prompt and reply) and then its own message. A failed turn ends it."""
    history: list[int] = []
    records: list[RequestRecord] = []
    for job in conversation:
        if job.turn:
            job = replace(job, token_ids=history + list(job.token_ids or ()))
        record = await send(job)
        records.append(record)
        if not record.ok:
            break
        history = list(job.token_ids or ()) + list(record.output_ids)
    return records


async def run_load(
    client: AsyncClient,
    jobs: list[Job],
    *,
    warmup: int = 0,
    concurrency: int | None = None,
    rate: float | None = None,
    seed: int = 0,
    ignore_eos: bool = False,
    progress=None,
    send=None,
) -> LoadResult:
    """Run ``warmup`` jobs first (not measured), then the rest; exactly one of
    ``concurrency`` (closed loop) or ``rate`` (open loop, Poisson arrivals) is given.
    The unit of either loop is a conversation (kvasir/bench/workload.py): one job, or
    several turns sent one after another.
    ``ignore_eos`` makes every request produce exactly its ``max_tokens``. ``send``: how a
    job is sent and timed (default: through ``client``; kvasir/bench/doors.py: over HTTP);
    ``client`` reads the daemon's statistics either way."""
    if (concurrency is None) == (rate is None):
        raise ValueError("give exactly one of concurrency or rate")
    if send is None:
        send = partial(one_request, client, ignore_eos=ignore_eos)
    if warmup:
        await _closed(send, jobs[:warmup], concurrency or 8, None)
    before = await client.stats()
    records, duration = await drive(
        send, jobs[warmup:], concurrency=concurrency, rate=rate, seed=seed, progress=progress
    )
    after = await fresh_stats(client, before, duration)
    return LoadResult(records, duration, before, after)


async def drive(
    send,
    jobs: list[Job],
    *,
    warmup: int = 0,
    concurrency: int | None = None,
    rate: float | None = None,
    seed: int = 0,
    progress=None,
) -> tuple[list[RequestRecord], float]:
    """``jobs`` through ``send`` after ``warmup`` of them (not measured), closed loop
    (``concurrency``) or open (``rate``): the measured records and their duration (first
    measured submission to last completion)."""
    if warmup:
        await _closed(send, jobs[:warmup], concurrency or 8, None)
    measured = jobs[warmup:]
    started = time.perf_counter()
    if concurrency is not None:
        records = await _closed(send, measured, concurrency, progress)
    else:
        records = await _open(send, measured, rate, random.Random(seed), progress)
    return records, max((r.submitted + r.e2e_s for r in records), default=started) - started


async def fresh_stats(client: AsyncClient, before: DaemonStats, window_s: float, timeout_s: float = 3.0) -> DaemonStats:
    """Stats whose every stage snapshot covers at least ``window_s`` since ``before``.

    Stages push their counters periodically, so a snapshot taken right after a short
    run may predate it; wait (briefly) for snapshots that include the whole run.
    """
    old = {s.index: s.wall_s for s in before.stages}
    deadline = time.monotonic() + timeout_s
    while True:
        after = await client.stats()
        if all(s.wall_s - old.get(s.index, s.wall_s) >= window_s for s in after.stages):
            return after
        if time.monotonic() > deadline:
            return after
        await asyncio.sleep(0.1)


async def _closed(send, jobs, concurrency, progress) -> list[RequestRecord]:
    queue = list(reversed(conversations(jobs)))
    records: list[RequestRecord] = []

    async def worker() -> None:
        while queue:
            records.extend(await converse(send, queue.pop()))
            if progress is not None:
                progress(len(records))

    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(queue)) or 1)))
    return records


async def _open(send, jobs, rate, rng, progress) -> list[RequestRecord]:
    records: list[RequestRecord] = []

    async def timed(conversation) -> None:
        records.extend(await converse(send, conversation))
        if progress is not None:
            progress(len(records))

    tasks = []
    for conversation in conversations(jobs):
        tasks.append(asyncio.create_task(timed(conversation)))
        await asyncio.sleep(rng.expovariate(rate))
    await asyncio.gather(*tasks)
    return records


def ring_report(result: LoadResult, slo: tuple[float, float] | None) -> dict:
    """The summary and per-stage figures of one run, as plain data."""
    summary = summary_data(result.records, result.duration_s, slo)
    before, after = result.stats_before, result.stats_after
    report = {"summary": summary, "stages": stage_fractions(before, after)}
    shards = shard_fractions(before, after)
    handoff = handoff_figures(result.records)
    report |= {"shards": shards} if shards else {}  # a mixture of experts with expert shards
    instances = instance_figures(result.records, result.duration_s)
    report |= {"instances": instances} if len(instances) > 1 else {}  # a fleet
    return report | ({"handoff": handoff} if handoff else {})  # a disaggregated plan


def instance_figures(records: list[RequestRecord], duration_s: float) -> dict[str, dict]:
    """Per instance that served measured requests: its share of them, its output tokens/s,
    TTFT and prefix hit rate."""
    out = {}
    for name in sorted({r.instance for r in records if r.instance}):
        mine = summarise([r for r in records if r.instance == name], duration_s, None)
        out[name] = {
            "requests": mine.requests,
            "output_tokens_per_s": mine.output_tokens_per_s,
            "ttft_p50": mine.ttft.p50,
            "ttft_p99": mine.ttft.p99,
            "prefix_hit_rate": mine.prefix_hit_rate,
        }
    return out


def summary_data(records, duration_s: float, slo: tuple[float, float] | None) -> dict:
    """``summarise`` as plain data (for reports and --json)."""
    summary = summarise(records, duration_s, slo)
    fields = summary.__dict__ | {name: getattr(summary, name).__dict__ for name in ("ttft", "itl", "e2e")}
    fields["prefix_hit_rate"] = summary.prefix_hit_rate
    return msgspec.to_builtins(fields)


def stage_fractions(before: DaemonStats, after: DaemonStats) -> list[dict]:
    """Per-stage busy/starved/blocked fractions and batch figures over a window."""
    out = []
    old = {s.index: s for s in before.stages}
    for s in after.stages:
        b = old.get(s.index)
        if b is None:
            continue
        shares = stage_shares(s, b)
        wall = max(shares.wall_s, 1e-9)
        batches = s.batches - b.batches
        out.append(
            {
                "index": s.index,
                "pool": s.pool,
                "instance": s.instance,
                "layers": list(s.layers),
                "window_s": wall,
                "busy": shares.busy,
                "hop_s": s.hop_s - b.hop_s,
                "hop_of_busy": (s.hop_s - b.hop_s) / max(shares.busy_s, 1e-9),
                "starved": shares.starved,
                "blocked": shares.blocked,
                "batches_per_s": batches / wall,
                "rows_per_batch": (s.rows - b.rows) / batches if batches else 0.0,
                "tokens_per_batch": (s.tokens - b.tokens) / batches if batches else 0.0,
                **_expert_load(s, b, shares.busy_s),
            }
        )
    return out


def _expert_load(s: StageStats, b: StageStats, busy_s: float) -> dict:
    """A MoE stage's expert load over the window, and its dispatch time's share of busy."""
    if s.experts is None:
        return {}
    load = window(s.experts.tokens, b.experts.tokens if b.experts is not None else None)
    dispatch = s.experts.dispatch_s - (b.experts.dispatch_s if b.experts is not None else 0.0)
    return {
        "expert_tokens": load,
        "expert_imbalance": imbalance(load),
        "dispatch_of_busy": dispatch / max(busy_s, 1e-9),
    }


def shard_fractions(before: DaemonStats, after: DaemonStats) -> list[dict]:
    """Per expert shard: busy/starved/blocked fractions, dispatches and routed tokens over a window."""
    out = []
    old = {s.number: s for s in before.shards}
    for s in after.shards:
        b = old.get(s.number)
        if b is None or b.pid != s.pid:
            continue
        shares = stage_shares(s, b)
        wall = max(shares.wall_s, 1e-9)
        out.append(
            {
                "number": s.number,
                "stage": s.stage,
                "experts": list(s.experts),
                "busy": shares.busy,
                "starved": shares.starved,
                "blocked": shares.blocked,
                "dispatches_per_s": (s.dispatches - b.dispatches) / wall,
                "tokens": s.tokens - b.tokens,
            }
        )
    return out


async def submit_only(client: AsyncClient, count: int) -> dict:
    """Submit ``count`` one-token requests as fast as one client can and count the replies.

    Every submission must get either ``Accepted`` or an immediate ``overloaded`` error:
    ``lost`` counts those that got neither (it must be 0).
    """
    from kvasir.wire.client import Accepted, ErrorEvent

    started = time.perf_counter()
    streams = [await client.submit(token_ids=[5, 6, 7], max_tokens=1, temperature=0) for _ in range(count)]
    sent_s = time.perf_counter() - started
    firsts = [await anext(aiter(stream)) for stream in streams]
    replied_s = time.perf_counter() - started
    accepted = [s for s, e in zip(streams, firsts) if isinstance(e, Accepted)]
    overloaded = sum(1 for e in firsts if isinstance(e, ErrorEvent) and e.code == "overloaded")
    await asyncio.gather(*(s.result() for s in accepted))  # let the accepted ones finish
    return {
        "submitted": count,
        "accepted": len(accepted),
        "overloaded": overloaded,
        "lost": count - len(accepted) - overloaded,
        "sent_per_s": count / sent_s if sent_s > 0 else 0.0,
        "replies_per_s": count / replied_s if replied_s > 0 else 0.0,
        "accepted_per_s": len(accepted) / replied_s if replied_s > 0 else 0.0,
    }
