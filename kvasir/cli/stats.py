"""``kvasir stats``: the daemon's and each stage's figures, once."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter

import click
import msgspec

from kvasir.cli.common import RUNTIME_DIR, connect, remote_options
from kvasir.cli.table import table_lines
from kvasir.units import format_bytes
from kvasir.wire.fleet import pool_name
from kvasir.wire.shares import PARTS, by_pool, stage_shares
from kvasir.wire.stats import StageStats


@click.command()
@click.option("--json", "as_json", is_flag=True, help='One JSON object: daemon-wide fields, "stages" and "shards".')
@click.option(
    "--wait",
    "wait_s",
    type=float,
    default=0.0,
    metavar="SECONDS",
    help="Wait up to SECONDS for the daemon to answer (e.g. right after starting it).",
)
@RUNTIME_DIR
@remote_options
def stats(as_json, wait_s, runtime_dir, remote) -> None:
    """Per-stage busy / starved / blocked time, batches, rows, tokens; the daemon's state,
    restarts and last failure. CUDA stages also show their device and GPU memory (held
    by tensors / reserved by the allocator). With a mixture-of-experts model: each expert
    shard's busy / starved / blocked time, dispatches and tokens routed to its experts,
    and each MoE stage's expert load (tokens per expert, busiest over mean) and the
    share of its busy time spent dispatching rows to shards and combining them."""
    client = connect(runtime_dir, wait_s, remote)
    try:
        daemon = client.stats()
    finally:
        client.close()
    skip = ("stages", "shards", "timeline", "instances", "drafts")
    body = {f: getattr(daemon, f) for f in daemon.__struct_fields__ if f not in skip}
    body["stages"] = [_as_object(stage) for stage in daemon.stages]
    body["shards"] = [_as_object(shard) for shard in daemon.shards]
    body["instances"] = [_as_object(i) | {"hit_rate": i.hit_rate} for i in daemon.instances]
    if (drafts := daemon.drafts) is not None:
        body["drafts"] = _as_object(drafts) | {
            "acceptance": drafts.acceptance,
            "tokens_per_pass": drafts.tokens_per_pass,
        }
    body = msgspec.to_builtins(body)
    for entry, figures in [*zip(body["stages"], daemon.stages), *zip(body["shards"], daemon.shards)]:
        shares = stage_shares(figures)
        entry.update({f"{part}_fraction": shares.fraction(part) for part in PARTS})
    for stage in body["stages"]:
        if stage["experts"] is not None:
            busy = stage["busy_s"]
            stage["experts"]["dispatch_fraction"] = stage["experts"]["dispatch_s"] / busy if busy > 0 else 0.0
    if any(stage.pool for stage in daemon.stages):
        body["pools"] = _pool_totals(daemon.stages)
    if as_json:
        click.echo(json.dumps(body))
        return
    click.echo(
        f"{body['state']}, uptime {body['uptime_s']:.1f} s, requests {body['requests']}, "
        f"in flight {body['in_flight']}, restarts {body['restarts']}"
    )
    if body["hosts_missing"]:
        click.echo(f"hosts missing: {', '.join(body['hosts_missing'])} (waiting for their kvasird join)")
    if body["last_failure"] is not None:
        click.echo(f"last failure {body['last_failure_age_s']:.0f} s ago: {body['last_failure']}")
    if body["clients_lost"] or body["client_bytes_waiting"] or body["malformed"]:
        click.echo(
            f"clients given up on {body['clients_lost']} (gone or not reading), events waiting for slow "
            f"clients {format_bytes(body['client_bytes_waiting'])}, malformed internal messages dropped {body['malformed']}"
        )
    if body["handoff"] is not None:
        h = body["handoff"]
        click.echo(
            f"hand-offs {h['count']}, {format_bytes(h['kv_bytes'])} of KV; time p50 {h['p50_s'] * 1000:.2f} ms, "
            f"p99 {h['p99_s'] * 1000:.2f} ms; copies at {h['gibps']:.2f} GiB/s"
        )
    if daemon.kv_pool is not None:
        click.echo(daemon.kv_pool.describe())
        if (sources := daemon.kv_pool.sources_line()) is not None:
            click.echo(sources)
        if (faults := daemon.kv_pool.faults_line()) is not None:
            click.echo(faults)
    if (cache_line := daemon.prefix_cache_line()) is not None:
        click.echo(cache_line)
    if daemon.drafts is not None:
        click.echo(f"speculative decoding: {daemon.drafts.describe()}")
    fleet = len(body["instances"]) > 1
    if fleet:
        _print_instances(body["instances"])
    if daemon.planner is not None:
        for line in daemon.planner.describe():
            click.echo(line)
    header: tuple[str, ...] = (
        "stage",
        "layers",
        "pid",
        "busy",
        "starved",
        "blocked",
        "batches",
        "rows",
        "tokens",
        "inflight",
        "kv reqs",
    )
    if any(s["host"] for s in body["stages"]):
        header = tuple("pid@host" if name == "pid" else name for name in header)
    rows: list[tuple[str, ...]] = [header]
    for s in body["stages"]:
        rows.append(
            (
                f"{s['index']} {s['instance'] if fleet else s['pool']}".rstrip(),
                f"[{s['layers'][0]}, {s['layers'][1]})",
                _pid_cell(s),
                *_share_cells(s),
                str(s["batches"]),
                str(s["rows"]),
                str(s["tokens"]),
                str(s["head"]["inflight"] if s["head"] is not None else 0),
                str(s["kv"]["requests"]),
            )
        )
    if any(s["gpu"] is not None for s in body["stages"]):  # CUDA stages: where, and device memory in use / reserved
        header += ("device", "gpu mem")
        rows = [header] + [row + (s["device"], _gpu_cell(s["gpu"])) for row, s in zip(rows[1:], body["stages"])]
    for line in table_lines(rows):
        click.echo(line)
    _print_experts(body)
    for name, pool in body.get("pools", {}).items():
        click.echo(
            f"{name} pool ({pool['stages']} stages): busy {pool['busy_fraction']:.0%}, "
            f"starved {pool['starved_fraction']:.0%}, blocked {pool['blocked_fraction']:.0%}"
        )


def _print_instances(instances: list[dict]) -> None:
    """A fleet's instances: where each stands, its load and its head's prefix cache."""
    rows: list[tuple[str, ...]] = [
        ("instance", "pool", "state", "stages", "requests", "routed", "backlog", "cached", "hit rate", "restarts")
    ]
    movable = any(i["movable"] for i in instances)
    if movable:
        rows[0] += ("moves",)
    for i in instances:
        prefix = i["prefix"]
        rows.append(
            (
                i["name"],
                pool_name(i["pool"], i["movable"]),
                i["state"],
                ",".join(map(str, i["stages"])),
                str(i["requests"]),
                str(i["routed"]),
                str(i["backlog"]),
                str(prefix["cached_blocks"]) if prefix is not None else "-",
                f"{i['hit_rate']:.0%}" if prefix is not None else "-",
                str(i["restarts"]),
            )
            + ((str(i["moves"]),) if movable else ())
        )
    for line in table_lines(rows):
        click.echo(line)
    for i in instances:
        if i["last_failure"]:
            click.echo(f"instance {i['name']} last failed: {i['last_failure']}")


def _as_object(value):
    """A statistics struct as JSON objects all the way down (on the wire they are arrays)."""
    if isinstance(value, msgspec.Struct):
        return {name: _as_object(getattr(value, name)) for name in value.__struct_fields__}
    if isinstance(value, tuple | list):
        return [_as_object(item) for item in value]
    return value


def _pid_cell(entry: dict) -> str:
    """A worker's pid, and in a plan across hosts the host it runs on."""
    return f"{entry['pid']}@{entry['host']}" if entry["host"] else str(entry["pid"])


def _gpu_cell(gpu: dict | None) -> str:
    """A CUDA stage's device memory, held by tensors / reserved by the allocator."""
    return f"{format_bytes(gpu['allocated_bytes'])} / {format_bytes(gpu['reserved_bytes'])}" if gpu else "-"


def _share_cells(entry: dict) -> tuple[str, str, str]:
    """A stage's or shard's busy, starved and blocked seconds with their shares."""
    busy, starved, blocked = (f"{entry[f'{part}_s']:.1f}s {entry[f'{part}_fraction']:.0%}" for part in PARTS)
    return busy, starved, blocked


def _print_experts(body: dict) -> None:
    """Each MoE stage's expert load, then each expert shard."""
    for s in body["stages"]:
        if (e := s["experts"]) is not None:
            dispatch = (
                f", dispatch {e['dispatch_s']:.2f}s {e['dispatch_fraction']:.0%} of busy" if e["dispatch_s"] else ""
            )
            click.echo(
                f"stage {s['index']} experts: tokens {list(e['tokens'])}, busiest {e['imbalance']:.2f}x the mean{dispatch}"
            )
    if not body["shards"]:
        return
    pid = "pid@host" if any(s["host"] for s in body["shards"]) else "pid"
    rows = [("shard", "stage", "experts", pid, "busy", "starved", "blocked", "dispatches", "tokens")]
    for s in body["shards"]:
        rows.append(
            (
                str(s["number"]),
                f"{s['stage']} {s['pool']}".rstrip(),
                f"[{s['experts'][0]}, {s['experts'][1]})",
                _pid_cell(s),
                *_share_cells(s),
                str(s["dispatches"]),
                str(s["tokens"]),
            )
        )
    for line in table_lines(rows):
        click.echo(line)


def _pool_totals(stages: list[StageStats]) -> dict[str, dict]:
    """Busy / starved / blocked per pool: its stages' seconds summed, and their shares
    (weighted by seconds, kvasir/wire/shares.py)."""
    counts: Counter[str] = Counter(stage.pool for stage in stages)
    pools = by_pool((stage.pool, stage_shares(stage)) for stage in stages)
    return {
        name: {"stages": counts[name], **dataclasses.asdict(shares)}
        | {f"{part}_fraction": shares.fraction(part) for part in PARTS}
        for name, shares in pools.items()
    }
