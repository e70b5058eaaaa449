"""``kvasir plan check``: a plan resolved against its model, with its memory and hand-off costs."""

from __future__ import annotations

import json

import click
import msgspec

from kvasir.cli.common import RUNTIME_DIR, fail
from kvasir.cli.table import table_lines
from kvasir.errors import KvasirError
from kvasir.units import MIB, format_bytes


@click.group()
def plan() -> None:
    """Inspect plan files (the TOML that says how a model is split into stages)."""


@plan.command("check")
@click.argument("path", type=click.Path(dir_okay=False, path_type=str))
@click.option("--json", "as_json", is_flag=True, help="Print the resolved plan as one JSON object.")
@click.option(
    "--link-gibps",
    type=float,
    default=1.0,
    show_default=True,
    help="Effective bandwidth (GiB/s) to price the KV hand-off between pools at.",
)
@click.option(
    "--interference-ms",
    type=float,
    default=20.0,
    show_default=True,
    help="Interference a disaggregated plan would avoid, per hand-off: the break-even bandwidth is priced against it.",
)
@click.option(
    "--prompt-tokens",
    default="128,512,1024,2048",
    show_default=True,
    help="Prompt lengths to price the hand-off for (comma-separated).",
)
@click.option(
    "--handoff-mib",
    type=float,
    multiple=True,
    help="Also price a hand-off of this many MiB (repeatable; e.g. 64 for the worked balance in docs/architecture.md).",
)
@RUNTIME_DIR
def plan_check(
    *,
    path: str,
    as_json: bool,
    link_gibps: float,
    interference_ms: float,
    prompt_tokens: str,
    handoff_mib: tuple[float, ...],
    runtime_dir: str | None,
) -> None:
    """Validate PATH and print the resolved plan, or exit 2 with the first problem.

    Per stage it shows the pool (in a disaggregated plan), layer range, parameter count
    and bytes, KV cache bytes and the boundary slots on the edge into the stage; per
    expert shard (a mixture-of-experts model's `[[stages.experts]]`) its stage, expert
    range, parameters and bytes, device and dispatch slot; then
    each edge's slot kind (shm, pinned or cuda-ipc: a stage's `edge` key, "auto" by
    default, picks CUDA IPC between GPU stages, pinned memory between a GPU and a CPU
    stage, shared memory between CPU stages) and why. Then
    the price of handing a prompt's KV from a prefill pool to a decode pool: KV bytes
    per prompt token, the hand-off size for a few prompt lengths, its time at
    --link-gibps and the break-even bandwidth against --interference-ms.
    (--runtime-dir is accepted like everywhere else; checking a plan needs no daemon.)
    """
    from kvasir.daemon.footprint import plan_footprint, shard_footprint
    from kvasir.daemon.resolve import resolve_plan

    try:
        lengths = [int(n) for n in prompt_tokens.split(",") if n.strip()]
    except ValueError:
        raise click.BadParameter(
            f"{prompt_tokens!r} is not a comma-separated list of integers", param_hint="--prompt-tokens"
        ) from None
    if link_gibps <= 0 or interference_ms <= 0 or any(n <= 0 for n in lengths) or any(m <= 0 for m in handoff_mib):
        raise click.UsageError("--link-gibps, --interference-ms, --prompt-tokens and --handoff-mib must be positive")
    try:
        resolved, source = resolve_plan(path)
        stages = plan_footprint(resolved, source)
        shards = shard_footprint(resolved, source)
    except KvasirError as exc:
        fail(exc)
    costs = _handoff_costs(resolved, source, link_gibps, interference_ms, lengths, handoff_mib)
    if as_json:
        body = {
            "plan": msgspec.to_builtins(resolved),
            "model": {
                "name": source.name,
                "architecture": source.config.model_type,
                "layers": source.num_layers,
                "hidden_size": int(source.config.hidden_size),
                "vocab_size": source.vocab_size,
                "experts": source.num_experts,
                "moe_layers": source.moe_layers,
                "weights": str(source.weights_dir) if source.weights_dir else None,
                "served": resolved.model.weights,
            },
            "stages": [msgspec.to_builtins(s.__dict__) for s in stages],
            "instances": _instances(resolved),
            "routes": _routes(resolved),
            "shards": [msgspec.to_builtins(s.__dict__) for s in shards],
            "handoff": costs,
        }
        click.echo(json.dumps(body))
        return
    _print_plan(path, resolved, source, stages)
    _print_shards(shards)
    _print_instances(resolved)
    _print_costs(costs)


def _instances(plan) -> list[dict]:
    """Each instance: its name, pool, stages (global indices) and hosts."""
    from kvasir.config.cluster import worker_host

    return [
        {
            "name": ring.name,
            "pool": ring.pool,
            "stages": list(range(ring.first, ring.last + 1)),
            "hosts": [worker_host(plan.cluster, stage.host) for stage in ring.plan.stages],
        }
        for ring in plan.rings()
    ]


def _routes(plan) -> list[dict]:
    """The KV hand-off links between every prefill and every decode instance."""
    from kvasir.config.fleet import handoff_routes

    return [
        {"prefill": p.name, "decode": d.name, "links": [msgspec.to_builtins(link.__dict__) for link in links]}
        for p, d, links in handoff_routes(plan)
    ]


def _print_instances(plan) -> None:
    """The instances with their stages and hosts, the routing policy, and the hand-off routes."""
    listed = _instances(plan)
    if len(listed) < 2:
        return  # one ring: the stage table says it all
    click.echo(f"route    {plan.route.policy} over {len(listed)} instances")
    for entry in listed:
        stages = ", ".join(map(str, entry["stages"]))
        pool = f"{entry['pool']} " if entry["pool"] else ""
        hosts = sorted({host for host in entry["hosts"] if host is not None})
        where = f" on {', '.join(hosts)}" if hosts else ""
        click.echo(f"instance {entry['name']}: {pool}stages {stages}{where}")
    for route in _routes(plan):
        links = ", ".join(
            f"{link['source']}->{link['target']} [{link['layers'][0]}, {link['layers'][1]}) {link['via']}"
            for link in route["links"]
        )
        click.echo(f"kv route {route['prefill']} -> {route['decode']}: {links}")


def _handoff_costs(plan, source, link_gibps, interference_ms, lengths, sizes_mib) -> dict:
    from kvasir.daemon.footprint import break_even_gibps, handoff_ms, kv_bytes_per_token

    per_token = kv_bytes_per_token(plan, source)
    rows = [{"prompt_tokens": n, "kv_bytes": n * per_token} for n in lengths]
    rows += [{"prompt_tokens": None, "kv_bytes": int(m * MIB)} for m in sizes_mib]
    for row in rows:
        row["handoff_ms"] = handoff_ms(row["kv_bytes"], link_gibps)
        row["break_even_gibps"] = break_even_gibps(row["kv_bytes"], interference_ms)
    return {
        "kv_bytes_per_token": per_token,
        "link_gibps": link_gibps,
        "interference_ms": interference_ms,
        "sizes": rows,
    }


def _print_costs(costs: dict) -> None:
    click.echo(
        f"hand-off {format_bytes(costs['kv_bytes_per_token'])} of KV per prompt token; at {costs['link_gibps']:g} GiB/s, "
        f"against {costs['interference_ms']:g} ms of interference avoided:"
    )
    header = ("prompt", "kv", "hand-off", "break-even")
    rows = [header]
    for row in costs["sizes"]:
        mib = row["kv_bytes"] / MIB
        rows.append(
            (
                f"{row['prompt_tokens']} tokens" if row["prompt_tokens"] else "-",
                f"{mib:g} MiB" if row["prompt_tokens"] is None else format_bytes(row["kv_bytes"]),
                f"{row['handoff_ms']:.4g} ms",
                f"{row['break_even_gibps']:.4g} GiB/s",
            )
        )
    for line in table_lines(rows, indent="  "):
        click.echo(line)


def _dtype_line(asked: str, resolved, source) -> str:
    """The dtype served in (activations, the boundary between stages, the KV cache), and
    why where the plan says "auto"."""
    from kvasir.daemon.resolve import dtype_choice

    line = f"{resolved.model.dtype}: activations, the boundary between stages and the KV cache"
    if asked == "auto":
        line += f' (model.dtype = "auto": {dtype_choice(resolved, source).why})'
    return line


def _weights_line(asked: str, resolved, source) -> str:
    """How the model's matrices are served (model.weights ``asked`` for), and the file's formats."""
    from kvasir.model.loader import stored_tensors

    m = resolved.model
    tensors = stored_tensors(source)
    if tensors is None:
        return f"{m.dtype} from the model folder (model.weights = {asked!r})"
    formats = tensors.formats()
    if source.scheme is not None:
        how = "as stored" if m.weights == "as_stored" else f"dequantised to {m.dtype}"
        count = sum(formats.values())
        return f"{source.scheme.describe()} matrices {how} (model.weights = {asked!r}); the checkpoint packs {count}"
    counted = ", ".join(f"{n} {name}" for name, n in formats.most_common())
    how = "Q4_0, Q4_1 and Q8_0 matrices as stored" if m.weights == "as_stored" else f"dequantised to {m.dtype}"
    return f"{how} (model.weights = {asked!r}); the GGUF holds {counted} tensors"


def _print_plan(path, resolved, source, stages) -> None:
    from kvasir.config.plan import load_plan

    m = resolved.model
    config = source.config
    click.echo(f"plan     {path}")
    click.echo(
        f"model    {source.name} ({config.model_type}, {source.num_layers} layers, hidden "
        f"{config.hidden_size}, vocab {source.vocab_size}), {m.dtype}, max_seq_len {m.max_seq_len}"
    )
    if source.weights_dir is None:
        click.echo("weights  not prepared yet (no converted weights in the cache)")
    asked = load_plan(path).model  # before "auto" was resolved
    click.echo(f"dtype    {_dtype_line(asked.dtype, resolved, source)}")
    click.echo(f"weights  {_weights_line(asked.weights, resolved, source)}")
    many = len(resolved.rings()) > 1
    for ring in resolved.rings():
        b, kv, pool = ring.plan.batch, ring.plan.kv, ring.pool
        name = f" ({ring.name})" if many else f" ({pool} pool)" if pool else ""
        click.echo(f"batch    max_rows {b.max_rows}, max_tokens {b.max_tokens}, inflight {b.inflight}{name}")
        click.echo(
            f"kv       {kv.num_blocks} blocks x {kv.block_size} tokens = "
            f"{kv.num_blocks * kv.block_size} tokens per stage{name}"
        )
    if (pool_spec := resolved.kv_pool) is not None:
        tiers = [f"{format_bytes(pool_spec.host_bytes)} of host memory"] if pool_spec.host_bytes else []
        tiers += [f"{format_bytes(pool_spec.disk_bytes)} in {pool_spec.disk_dir}"] if pool_spec.disk_bytes else []
        click.echo(
            f"kv pool  {' and '.join(tiers)} on each host; a head waits {pool_spec.load_timeout_s:g} s for a read-back"
        )
    if (spec := resolved.speculative) is not None:
        how = (
            f"prompt lookup (n-grams {spec.ngram_max} down to {spec.ngram_min})"
            if spec.method == "ngram"
            else f"draft model {spec.draft_model} (greedy, in each head's process)"
        )
        click.echo(
            f"drafts   {how}, up to {spec.num_tokens} per decode row; none in batches of more than "
            f"{spec.max_rows} decode rows, probes only below {spec.min_acceptance:.0%} confirmed"
        )
    if resolved.planner is not None:
        click.echo(_planner_line(resolved))
    if resolved.disaggregated:
        click.echo(f"handoff  prefill KV not taken by the decode pool within {resolved.handoff.lease_s:g} s is freed")
    br = resolved.bridge
    click.echo(
        f"bridge   max_waiting {br.max_waiting}, max_per_client {br.max_per_client}, max_client_queue {br.max_client_queue}"
        + (f", tcp {br.tcp} ({'CURVE' if br.server_key else 'no keys: loopback only'})" if br.tcp else "")
    )
    if resolved.http is not None:
        http = resolved.http
        keys = f"bearer keys from {http.api_keys}" if http.api_keys else "no keys: loopback only"
        click.echo(
            f"http     {http.listen} ({keys}), {http.workers} front process{'es' if http.workers > 1 else ''}, "
            f"model {http.model_name!r}: /v1/models, /v1/completions, /v1/chat/completions, /health, /metrics"
        )
    sup = resolved.supervise
    click.echo(
        f"restarts at most {sup.max_restarts} in {sup.restart_window_s:g} s, "
        f"hung after {sup.heartbeat_timeout_s:g} s without a heartbeat"
    )
    if resolved.cluster is not None:
        _print_cluster(resolved)
    header = ("stage", "role", "layers", "device", "threads", "params", "param bytes", "kv bytes", "boundary in")
    rows = [header + (("host",) if resolved.cluster else ()) + (("instance",) if many else ())]
    for s in stages:
        slots = f"{s.slots} x {format_bytes(s.slot_bytes)} {s.edge}" if s.slots else "-"
        row = (
            str(s.index),
            f"{s.pool} {s.role}" if s.pool else s.role,
            f"[{s.layers[0]}, {s.layers[1]})",
            s.device,
            str(s.threads) if s.solo_threads in (None, s.threads) else f"{s.threads}, solo {s.solo_threads}",
            f"{s.parameters:,}",
            format_bytes(s.parameter_bytes),
            format_bytes(s.kv_bytes),
            slots,
        )
        rows.append(row + ((str(s.host),) if resolved.cluster else ()) + ((s.instance,) if many else ()))
    for line in table_lines(rows):
        click.echo(line)
    for s in stages:
        if s.edge:
            click.echo(f"edge     {s.index - 1} -> {s.index}: {s.edge} ({s.edge_reason})")


def _planner_line(plan) -> str:
    """[planner]: who may move, and whether the planner or a person moves them."""
    spec = plan.planner
    movable = ", ".join(ring.name for ring in plan.rings() if ring.movable) or "none"
    how = (
        f"the planner moves them against TTFT {spec.ttft_s:g} s and ITL {spec.itl_s:g} s at p{spec.percentile:g}, "
        f"every {spec.interval_s:g} s (patience {spec.patience}, headroom {spec.headroom:g}, "
        f"cooldown {spec.cooldown_s:g} s)"
        if spec.enabled
        else "moved by hand (`kvasir instances move`)"
    )
    return f"planner  movable: {movable}; {how}; at least {spec.min_prefill} prefill and {spec.min_decode} decode"


def _print_shards(shards) -> None:
    if not shards:
        return
    hosts = any(s.host is not None for s in shards)
    header: tuple[str, ...] = ("shard", "stage", "experts", "device", "threads", "params", "param bytes", "dispatch")
    rows = [header + (("host",) if hosts else ())]
    for s in shards:
        row: tuple[str, ...] = (
            str(s.number),
            str(s.stage),
            f"[{s.experts[0]}, {s.experts[1]})",
            s.device,
            str(s.threads),
            f"{s.parameters:,}",
            format_bytes(s.parameter_bytes),
            f"{s.slots} x {format_bytes(s.dispatch_bytes)} {s.dispatch_kind}",
        )
        rows.append(row + ((str(s.host),) if hosts else ()))
    for line in table_lines(rows):
        click.echo(line)


def _print_cluster(plan) -> None:
    """The leader, the keys, and each host's address with the ports its processes bind."""
    from kvasir.transport.routes import Placement, Routes

    placement = Placement.of(plan)
    routes = Routes.of(placement) if placement.spans_hosts else None
    click.echo(f"cluster  leader {plan.cluster.leader}; keys {plan.cluster.keys}")
    for name, host in plan.hosts.items():
        ports = routes.ports(name) if routes is not None else []
        bound = f"ports {ports[0]}-{ports[-1]} (TCP, CURVE)" if ports else "no ports (runs no worker)"
        standby = "; standby: its instances serve once it joins" if host.standby else ""
        click.echo(f"  host {name}  {host.address}: {bound}{standby}")
