"""``kvasir top``: a live terminal view of a running daemon, refreshed about once a second.

Each frame compares two stats snapshots: per stage the busy / starved / blocked shares
of the interval as bars, batches and tokens per second, KV held (and, where stages run
on GPUs, each stage's device and the device memory it holds); daemon-wide the requests
in flight, the head's queue and batches in flight (in a disaggregated plan: each pool's
head, and the requests being handed from prefill to decode), and output tokens/s. With
expert shards, a line per shard (its shares as bars, dispatches and routed tokens per
second) and per MoE stage its expert load over the interval.
"""

from __future__ import annotations

import contextlib
import os
import select
import sys
import termios
import time
import tty
from collections.abc import Callable

import click

from kvasir.cli.common import RUNTIME_DIR, connect
from kvasir.errors import KvasirError
from kvasir.units import GIB
from kvasir.wire.client import DaemonStats
from kvasir.wire.shares import imbalance, stage_shares, window
from kvasir.wire.stats import HeadQueue, StageStats

BAR = 24
HEADER = (
    f"stage  layers    [{'busy # / starved - / blocked x':^{BAR}}]  busy starv block  batches/s  tokens/s   KV blocks"
)


def bar(busy: float, starved: float, blocked: float, width: int = BAR) -> str:
    """``#`` busy, ``-`` starved, ``x`` blocked, spaces for the rest (unaccounted)."""
    cells = [round(busy * width), round(starved * width), round(blocked * width)]
    while sum(cells) > width:
        cells[cells.index(max(cells))] -= 1
    return "#" * cells[0] + "-" * cells[1] + "x" * cells[2] + " " * (width - sum(cells))


def frame(before: DaemonStats, after: DaemonStats) -> list[str]:
    """The lines of one frame: what changed between two snapshots."""
    seconds = max(after.uptime_s - before.uptime_s, 1e-9)
    pooled = any(s.pool for s in after.stages)
    gpus = any(s.device != "cpu" for s in after.stages)
    lines = [
        f"kvasir  up {after.uptime_s:7.0f} s   requests {after.requests}   in flight {after.in_flight}"
        + _queues(after.stages, pooled)
        + f"   {(after.tokens_out - before.tokens_out) / seconds:7.1f} tokens/s out"
        + (f"   restarts {after.restarts}" if after.restarts else "")
        + (f"   {after.state.upper()}" if after.state != "serving" else ""),
        ("pool     " if pooled else "") + HEADER + ("  device   GPU memory" if gpus else ""),
    ]
    old = {s.index: s for s in before.stages}
    for s in after.stages:
        line = _stage_line(old.get(s.index), s)
        if gpus and s.gpu is not None:
            line = f"{line:<{len(HEADER)}}  {s.device:<8} {s.gpu.allocated_bytes / GIB:6.2f} GiB"  # under the header's column
        lines.append((f"{s.pool:<9}" if pooled else "") + line)
    lines += _expert_lines(before, after, "         " if pooled else "")
    if (cache_line := after.prefix_cache_line()) is not None:
        lines.append(cache_line)
    if after.drafts is not None:
        lines.append(f"speculative decoding: {after.drafts.describe()}")
    return lines + _instance_lines(before, after, seconds)


def _instance_lines(before: DaemonStats, after: DaemonStats, seconds: float) -> list[str]:
    """A fleet's instances: state, requests on each, routed per second, prefix cache."""
    if len(after.instances) < 2:
        return []
    old = {i.name: i for i in before.instances}
    lines = []
    for i in after.instances:
        routed = (i.routed - old[i.name].routed) / seconds if i.name in old else 0.0
        cache = f", {i.prefix.cached_blocks} blocks cached, hit {i.hit_rate:.0%}" if i.prefix is not None else ""
        restarts = f", restarts {i.restarts}" if i.restarts else ""
        state = "" if i.state == "serving" else f" {i.state.upper()}"
        pool = f" {i.pool}" if i.pool else ""
        lines.append(
            f"instance {i.name}{pool}{state}: stages {i.stages[0]}-{i.stages[-1]}, {i.requests} requests, "
            f"{routed:.1f} routed/s, {i.backlog} prompt tokens queued{cache}{restarts}"
        )
    return lines


def _expert_lines(before: DaemonStats, after: DaemonStats, pad: str) -> list[str]:
    """Per shard: shares as bars, dispatches/s and routed tokens/s; per MoE stage: load."""
    lines = []
    old = {s.number: s for s in before.shards}
    for s in after.shards:
        b = old.get(s.number)
        name = f"{f's{s.number}:{s.stage}':>5}  e{s.experts[0]:>2}-{s.experts[1]:<4}"  # lined up with the stages
        if b is None or b.pid != s.pid or s.wall_s <= b.wall_s:
            lines.append(f"{pad}{name}  (waiting for the shard's next report)")
            continue
        wall, shares = s.wall_s - b.wall_s, stage_shares(s, b)
        lines.append(
            f"{pad}{name}  [{bar(shares.busy, shares.starved, shares.blocked)}]  {shares.busy:4.0%} "
            f"{shares.starved:5.0%} {shares.blocked:5.0%}  {(s.dispatches - b.dispatches) / wall:9.1f}  "
            f"{(s.tokens - b.tokens) / wall:8.1f}   (dispatches/s, routed tokens/s)"
        )
    stages = {stage.index: stage for stage in before.stages}
    for stage in after.stages:
        if stage.experts is not None:
            earlier = stages.get(stage.index)
            before_load = earlier.experts.tokens if earlier is not None and earlier.experts is not None else None
            load = window(stage.experts.tokens, before_load)
            lines.append(
                f"{pad}stage {stage.index} expert load: busiest {imbalance(load):.2f}x the mean, tokens {load}"
            )
    return lines


def _queues(stages: list[StageStats], pooled: bool) -> str:
    """The head's queue and batches in flight; in a disaggregated plan, each pool's head."""
    heads: dict[str, StageStats] = {}
    for s in sorted(stages, key=lambda s: s.index):
        heads.setdefault(s.pool, s)  # a pool's head is its first stage

    def counts(pool: str, sep: str) -> str:
        head = heads.get(pool)
        queue = head.head if head is not None and head.head is not None else HeadQueue()
        return f"queued {queue.waiting}{sep}batches in flight {queue.inflight}"

    if not pooled:
        return "   " + counts("", "   ")
    prefill = heads.get("prefill")
    handing_off = prefill.head.handing_off if prefill is not None and prefill.head is not None else 0
    return f"   prefill: {counts('prefill', ', ')}, handing off {handing_off}   decode: {counts('decode', ', ')}"


def _stage_line(b: StageStats | None, s: StageStats) -> str:
    if b is None or b.pid != s.pid or s.wall_s <= b.wall_s:
        return f"{s.index:5d}  {s.layers[0]:>3}-{s.layers[1]:<4}  (waiting for the stage's next report)"
    wall = s.wall_s - b.wall_s
    shares = stage_shares(s, b)
    busy, starved, blocked = shares.busy, shares.starved, shares.blocked
    return (
        f"{s.index:5d}  {s.layers[0]:>3}-{s.layers[1]:<4}  [{bar(busy, starved, blocked)}]  {busy:4.0%} {starved:5.0%} {blocked:5.0%}"
        f"  {(s.batches - b.batches) / wall:9.1f}  {(s.tokens - b.tokens) / wall:8.1f}   {s.kv.blocks:9d}"
    )


@contextlib.contextmanager
def _keys():
    """Single keypresses from a terminal's stdin (cbreak mode, restored on exit); a
    function that waits up to some seconds and returns the key pressed, or ''."""
    if not sys.stdin.isatty():
        yield lambda seconds: time.sleep(seconds) or ""
        return
    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    tty.setcbreak(fd)
    try:

        def wait(seconds: float) -> str:
            ready, _, _ = select.select([fd], [], [], seconds)
            return os.read(fd, 1).decode(errors="replace") if ready else ""

        yield wait
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def run_top(stats: Callable[[], DaemonStats], interval_s: float, count: int | None, echo=click.echo) -> None:
    """Draw frames until q, Ctrl-C, ``count`` frames, or the daemon going away."""
    clear = "\x1b[H\x1b[2J" if sys.stdout.isatty() else ""
    before = stats()
    shown = 0
    with _keys() as wait:
        try:
            while count is None or shown < count:
                if wait(interval_s).lower() == "q":
                    return
                after = stats()
                echo(clear + "\n".join(frame(before, after)) + ("\n(q to quit)" if clear else ""))
                before = after
                shown += 1
        except KeyboardInterrupt:
            return


@click.command()
@click.option("--interval", type=float, default=1.0, show_default=True, help="Seconds between frames.")
@click.option("--count", type=int, default=None, help="Stop after this many frames (default: until q or Ctrl-C).")
@RUNTIME_DIR
def top(interval, count, runtime_dir) -> None:
    """Live view: per-stage busy / starved / blocked bars, batches in flight, queue, tokens/s.

    Press q (or Ctrl-C) to quit. Exit code 3 when no daemon answers (or it stops answering).
    """
    from kvasir.cli.top import run_top
    from kvasir.client import NoDaemon

    if interval <= 0 or (count is not None and count < 1):
        raise click.UsageError("--interval must be > 0 and --count >= 1")
    client = connect(runtime_dir)
    try:
        run_top(lambda: client.stats(timeout_s=max(5.0, 3 * interval)), interval, count)
    except (NoDaemon, KvasirError) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(3)
    finally:
        client.close()
