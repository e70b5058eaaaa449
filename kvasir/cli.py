"""Command line: ``kvasir`` (client side) and ``kvasird`` (the daemon)."""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path

import click
import msgspec

from kvasir import __version__
from kvasir.bench.command import bench
from kvasir.errors import KvasirError
from kvasir.transport import default_runtime_dir


RUNTIME_DIR = click.option(
    "--runtime-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="The daemon's runtime dir (default: $KVASIR_RUNTIME_DIR, else $XDG_RUNTIME_DIR/kvasir, else /tmp/kvasir-$UID).",
)


def remote_options(command):
    """--connect / --key / --server-key (or $KVASIR_CONNECT, $KVASIR_KEY, $KVASIR_SERVER_KEY):
    talk to a daemon's TCP endpoint instead of its runtime dir; passed on as ``remote``."""

    @functools.wraps(command)
    def wrapper(*args, endpoint, client_key, server_key, **kwargs):
        from kvasir.client import Remote

        if endpoint is None and (client_key or server_key):
            raise click.UsageError("--key and --server-key go with --connect tcp://HOST:PORT")
        if (client_key is None) != (server_key is None):
            raise click.UsageError("a CURVE connection needs both --key (yours) and --server-key (the daemon's)")
        remote = None
        if endpoint is not None:
            remote = Remote(endpoint, Path(client_key) if client_key else None, Path(server_key) if server_key else None)
        return command(*args, remote=remote, **kwargs)

    for option in (
        click.option("--server-key", type=click.Path(dir_okay=False), envvar="KVASIR_SERVER_KEY",
                     help="With --connect: the daemon's public key file (server.key)."),
        click.option("--key", "client_key", type=click.Path(dir_okay=False), envvar="KVASIR_KEY",
                     help="With --connect: this client's key pair (NAME.key_secret from `kvasir keys generate`)."),
        click.option("--connect", "endpoint", metavar="tcp://HOST:PORT", envvar="KVASIR_CONNECT",
                     help="Talk to the daemon's TCP endpoint (the plan's bridge.tcp) instead of its runtime dir."),
    ):
        wrapper = option(wrapper)
    return wrapper


def _fail(exc: KvasirError) -> None:
    click.echo(f"error: {exc}", err=True)
    sys.exit(2)


def _size(n: int) -> str:
    """Bytes in binary units: 512 B, 288.0 KiB, 1.5 GiB."""
    if n < 1024:
        return f"{n} B"
    value, unit = n / 1024, "KiB"
    for bigger in ("MiB", "GiB"):
        if value < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{value:.1f} {unit}"


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kvasir")
def kvasir() -> None:
    """Kvasir: serve a language model as an in-flight ring of pipeline stages."""


@kvasir.group()
def plan() -> None:
    """Inspect plan files (the TOML that says how a model is split into stages)."""


@plan.command("check")
@click.argument("path", type=click.Path(dir_okay=False, path_type=str))
@click.option("--json", "as_json", is_flag=True, help="Print the resolved plan as one JSON object.")
@click.option("--link-gibps", type=float, default=1.0, show_default=True,
              help="Effective bandwidth (GiB/s) to price the KV hand-off between pools at.")
@click.option("--interference-ms", type=float, default=20.0, show_default=True,
              help="Interference a disaggregated plan would avoid, per hand-off: the break-even bandwidth is priced against it.")
@click.option("--prompt-tokens", default="128,512,1024,2048", show_default=True,
              help="Prompt lengths to price the hand-off for (comma-separated).")
@click.option("--handoff-mib", type=float, multiple=True,
              help="Also price a hand-off of this many MiB (repeatable; e.g. 64 for MISSION.md's worked balance).")
@RUNTIME_DIR
def plan_check(path: str, as_json: bool, link_gibps: float, interference_ms: float, prompt_tokens: str,
               handoff_mib: tuple[float, ...], runtime_dir: str | None) -> None:
    """Validate PATH and print the resolved plan, or exit 2 with the first problem.

    Per stage it shows the pool (in a disaggregated plan), layer range, parameter count
    and bytes, KV cache bytes and the boundary slots on the edge into the stage; then
    each edge's slot kind (shm, pinned or cuda-ipc: a stage's `edge` key, "auto" by
    default, picks CUDA IPC between GPU stages, pinned memory between a GPU and a CPU
    stage, shared memory between CPU stages) and why. Then
    the price of handing a prompt's KV from a prefill pool to a decode pool: KV bytes
    per prompt token, the hand-off size for a few prompt lengths, its time at
    --link-gibps and the break-even bandwidth against --interference-ms.
    (--runtime-dir is accepted like everywhere else; checking a plan needs no daemon.)
    """
    from kvasir.footprint import plan_footprint
    from kvasir.resolve import resolve_plan

    try:
        lengths = [int(n) for n in prompt_tokens.split(",") if n.strip()]
    except ValueError:
        raise click.BadParameter(f"{prompt_tokens!r} is not a comma-separated list of integers", param_hint="--prompt-tokens")
    if link_gibps <= 0 or interference_ms <= 0 or any(n <= 0 for n in lengths) or any(m <= 0 for m in handoff_mib):
        raise click.UsageError("--link-gibps, --interference-ms, --prompt-tokens and --handoff-mib must be positive")
    try:
        resolved, source = resolve_plan(path)
        stages = plan_footprint(resolved, source)
    except KvasirError as exc:
        _fail(exc)
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
                "weights": str(source.weights_dir) if source.weights_dir else None,
            },
            "stages": [msgspec.to_builtins(s.__dict__) for s in stages],
            "handoff": costs,
        }
        click.echo(json.dumps(body))
        return
    _print_plan(path, resolved, source, stages)
    _print_costs(costs)


def _handoff_costs(plan, source, link_gibps, interference_ms, lengths, sizes_mib) -> dict:
    from kvasir.footprint import MIB, break_even_gibps, handoff_ms, kv_bytes_per_token

    per_token = kv_bytes_per_token(plan, source)
    rows = [{"prompt_tokens": n, "kv_bytes": n * per_token} for n in lengths]
    rows += [{"prompt_tokens": None, "kv_bytes": int(m * MIB)} for m in sizes_mib]
    for row in rows:
        row["handoff_ms"] = handoff_ms(row["kv_bytes"], link_gibps)
        row["break_even_gibps"] = break_even_gibps(row["kv_bytes"], interference_ms)
    return {"kv_bytes_per_token": per_token, "link_gibps": link_gibps, "interference_ms": interference_ms, "sizes": rows}


def _print_costs(costs: dict) -> None:
    click.echo(
        f"hand-off {_size(costs['kv_bytes_per_token'])} of KV per prompt token; at {costs['link_gibps']:g} GiB/s, "
        f"against {costs['interference_ms']:g} ms of interference avoided:"
    )
    header = ("prompt", "kv", "hand-off", "break-even")
    rows = [header]
    for row in costs["sizes"]:
        mib = row["kv_bytes"] / (1 << 20)
        rows.append((
            f"{row['prompt_tokens']} tokens" if row["prompt_tokens"] else "-",
            f"{mib:g} MiB" if row["prompt_tokens"] is None else _size(row["kv_bytes"]),
            f"{row['handoff_ms']:.4g} ms",
            f"{row['break_even_gibps']:.4g} GiB/s",
        ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for r in rows:
        click.echo("  " + "  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())


def _print_plan(path, resolved, source, stages) -> None:
    m = resolved.model
    config = source.config
    click.echo(f"plan     {path}")
    click.echo(
        f"model    {source.name} ({config.model_type}, {source.num_layers} layers, hidden "
        f"{config.hidden_size}, vocab {source.vocab_size}), {m.dtype}, max_seq_len {m.max_seq_len}"
    )
    if source.weights_dir is None:
        click.echo("weights  not prepared yet (no converted weights in the cache)")
    for pool, view in resolved.pools():
        b, kv = view.batch, view.kv
        name = f" ({pool} pool)" if pool else ""
        click.echo(f"batch    max_rows {b.max_rows}, max_tokens {b.max_tokens}, inflight {b.inflight}{name}")
        click.echo(
            f"kv       {kv.num_blocks} blocks x {kv.block_size} tokens = "
            f"{kv.num_blocks * kv.block_size} tokens per stage{name}"
        )
    if resolved.disaggregated:
        click.echo(f"handoff  prefill KV not taken by the decode pool within {resolved.handoff.lease_s:g} s is freed")
    br = resolved.bridge
    click.echo(
        f"bridge   max_waiting {br.max_waiting}, max_per_client {br.max_per_client}, max_client_queue {br.max_client_queue}"
        + (f", tcp {br.tcp} ({'CURVE' if br.server_key else 'no keys: loopback only'})" if br.tcp else "")
    )
    sup = resolved.supervise
    click.echo(
        f"restarts at most {sup.max_restarts} in {sup.restart_window_s:g} s, "
        f"hung after {sup.heartbeat_timeout_s:g} s without a heartbeat"
    )
    header = ("stage", "role", "layers", "device", "threads", "params", "param bytes", "kv bytes", "boundary in")
    rows = [header]
    for s in stages:
        slots = f"{s.slots} x {_size(s.slot_bytes)} {s.edge}" if s.slots else "-"
        rows.append(
            (
                str(s.index),
                f"{s.pool} {s.role}" if s.pool else s.role,
                f"[{s.layers[0]}, {s.layers[1]})",
                s.device,
                str(s.threads),
                f"{s.parameters:,}",
                _size(s.parameter_bytes),
                _size(s.kv_bytes),
                slots,
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for r in rows:
        click.echo("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())
    for s in stages:
        if s.edge:
            click.echo(f"edge     {s.index - 1} -> {s.index}: {s.edge} ({s.edge_reason})")


@kvasir.group()
def model() -> None:
    """Prepare and list models in the cache ($KVASIR_CACHE_DIR, else ~/.cache/kvasir)."""


@model.command("prepare")
@click.argument("source", default="smollm2-135m")
def model_prepare(source: str) -> None:
    """Convert SOURCE (a built-in alias or a .gguf file) into the cache, once.

    Later loads read the converted safetensors folder; each stage reads only its own
    tensors. A folder that is already a Hugging Face model needs no preparing.
    """
    from kvasir.model.convert import ConversionInterrupted, prepare
    from kvasir.model.source import resolve_source

    try:
        prepared = prepare(resolve_source(source))
    except ConversionInterrupted as exc:
        click.echo(f"kvasir: {exc}", err=True)
        sys.exit(1)
    except KvasirError as exc:
        _fail(exc)
    click.echo(f"{source}: ready in {prepared.weights_dir}")


@model.command("list")
def model_list() -> None:
    """Show the built-in models and the converted folders in the cache."""
    from kvasir.model.source import BUILTIN_CONFIGS, cache_dir

    root = cache_dir()
    click.echo(f"cache {root}")
    # names starting with "." are conversions in progress (or killed): never listed or used
    folders = sorted(p for p in root.iterdir() if not p.name.startswith(".") and (p / "config.json").is_file()) if root.is_dir() else []
    names = {p.name for p in folders}
    for alias in sorted(BUILTIN_CONFIGS):
        state = "prepared" if alias in names else "not prepared (kvasir model prepare " + alias + ")"
        click.echo(f"  {alias:<24} built-in, {state}")
    for folder in folders:
        if folder.name not in BUILTIN_CONFIGS:
            size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
            click.echo(f"  {folder.name:<24} converted, {_size(size)}")


kvasir.add_command(bench)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kvasird")
def kvasird() -> None:
    """The Kvasir daemon."""


@kvasird.command("start")
@click.option("--plan", "plan_path", type=click.Path(dir_okay=False), default=None,
              help="Plan file (default: the built-in two-stage plan for smollm2-135m).")
@RUNTIME_DIR
@click.option("--ready-timeout", type=float, default=300.0, show_default=True,
              help="Seconds to wait for every stage to load and report ready.")
@click.option("--drain-timeout", type=float, default=30.0, show_default=True,
              help="On SIGTERM/SIGINT, seconds to let running requests finish.")
@click.option("--stop-with-parent", is_flag=True,
              help="Drain and stop, as on SIGTERM, when the process that started kvasird exits "
                   "(kvasir bench starts its daemons so: a killed bench leaves none behind).")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info")
def start(plan_path: str | None, runtime_dir: str | None, ready_timeout: float, drain_timeout: float,
          stop_with_parent: bool, log_level: str) -> None:
    """Serve a plan in the foreground until SIGTERM or SIGINT (then drain and exit 0).

    Validates the plan first (exit 2 on a bad plan, before anything is spawned), makes
    the runtime dir (mode 0700; an existing one must be a real directory of this user
    holding only Kvasir's lock and sockets, else exit 1), spawns one worker per stage
    and the bridge, waits for
    each to report ready, and serves. A worker that dies or hangs ends every request in
    the daemon with stage_failed and the workers are restarted (the plan's [supervise]
    section bounds how often); past that bound the daemon exits 1.
    """
    from kvasir.launcher import Launcher, Timeouts, check_host, run_launcher
    from kvasir.model.convert import ConversionInterrupted, prepare
    from kvasir.logs import setup_logging
    from kvasir.notify import ServiceNotifier
    from kvasir.resolve import resolve_plan

    path = plan_path or str(default_plan_path())
    try:
        plan, source = resolve_plan(path)
        check_host(plan)
    except KvasirError as exc:
        _fail(exc)
    log = setup_logging(log_level, role="launcher", pid=os.getpid())
    try:
        source = prepare(source, log)
        source.require_weights()
    except ConversionInterrupted as exc:
        log.info("stopped during start-up", why=str(exc))
        sys.exit(0)
    except KvasirError as exc:
        _fail(exc)
    plan = msgspec.structs.replace(plan, model=msgspec.structs.replace(plan.model, source=source.name))
    launcher = Launcher(
        plan=plan,
        source=source,
        runtime_dir=Path(runtime_dir) if runtime_dir else default_runtime_dir(),
        log=log,
        timeouts=Timeouts(ready_s=ready_timeout, drain_s=drain_timeout),
        log_level=log_level,
        notifier=ServiceNotifier.from_environment(),
        parent_pid=os.getppid() if stop_with_parent else None,
    )
    sys.exit(run_launcher(launcher))


def default_plan_path() -> Path:
    return Path(__file__).parent / "plans" / "smollm2-2stage.toml"


# -- client commands -------------------------------------------------------------------------
def _connect(runtime_dir: str | None, wait_s: float = 0.0, remote=None):
    """A client to the daemon; exit 3 when none answers (after waiting up to ``wait_s``)
    or it refuses this client's key."""
    import time

    from kvasir.client import Client, NoDaemon, NotAuthorised, RuntimeDirError

    deadline = time.monotonic() + wait_s
    while True:
        try:
            return Client(runtime_dir, remote=remote)
        except (NotAuthorised, RuntimeDirError) as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(3)
        except NoDaemon as exc:
            if time.monotonic() >= deadline:
                click.echo(f"error: {exc}", err=True)
                sys.exit(3)
            time.sleep(0.25)


def _event_json(event) -> str:
    return json.dumps(msgspec.to_builtins(event))


@kvasir.command()
@click.argument("prompt", required=False)
@click.option("--ids", help="Submit these comma-separated token ids instead of PROMPT text.")
@click.option("--max-tokens", type=int, default=128, show_default=True, help="Output tokens at most.")
@click.option("--temperature", type=float, default=0.7, show_default=True, help="0 means greedy.")
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--top-k", type=int, default=0, show_default=True, help="0 means off.")
@click.option("--seed", type=int, default=None, help="Same seed, same output.")
@click.option("--chat", is_flag=True, help="Wrap PROMPT in the model's chat template.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per event line (token ids included).")
@RUNTIME_DIR
@remote_options
def generate(prompt, ids, max_tokens, temperature, top_p, top_k, seed, chat, as_json, runtime_dir, remote) -> None:
    """Generate from PROMPT (or --ids) and stream the text as it arrives.

    Exit code: 0 finished, 1 error or cancelled, 2 bad arguments, 3 no daemon.
    """
    from kvasir.messages import Cancelled, ErrorEvent, Finished, TokenOut

    if (prompt is None) == (ids is None):
        raise click.UsageError("give PROMPT text or --ids, not both and not neither")
    token_ids = None
    if ids is not None:
        try:
            token_ids = [int(part) for part in ids.split(",") if part.strip()]
        except ValueError:
            raise click.UsageError(f"--ids must be comma-separated integers, got {ids!r}") from None
    client = _connect(runtime_dir, remote=remote)
    code = 1
    printed = False
    stream = None
    try:
        stream = client.submit(
            prompt, token_ids=token_ids, chat=chat, max_tokens=max_tokens,
            temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
        )
        for event in client.events(stream):
            if as_json:
                click.echo(_event_json(event))
            elif isinstance(event, TokenOut):
                click.echo(event.text if token_ids is None else f"{event.token_id} ", nl=False)
                printed = True
            elif isinstance(event, Finished):
                click.echo("")
            elif isinstance(event, (ErrorEvent, Cancelled)):
                if printed:
                    click.echo("")
                label = f"{event.code}: {event.message}" if isinstance(event, ErrorEvent) else "cancelled"
                click.echo(f"error: {label}", err=True)
            if isinstance(event, Finished):
                code = 0
    except KeyboardInterrupt:
        if stream is not None and stream.request_id is not None:
            try:
                client.cancel(stream.request_id)
            except Exception:
                pass  # the daemon may be going away too
        click.echo("", err=True)
        code = 130
    finally:
        client.close()
    sys.exit(code)


@kvasir.command()
@click.option("--request", "request_id", type=int, default=None, help="Only this request's tokens.")
@click.option("--json", "as_json", is_flag=True, help="One JSON token object per line.")
@click.option("--count", type=int, default=None, help="Exit after this many token events.")
@RUNTIME_DIR
def tail(request_id, as_json, count, runtime_dir) -> None:
    """Print token events live as they leave the tail, until interrupted."""
    import zmq

    from kvasir.messages import TokenOut
    from kvasir.transport import Endpoints

    client = _connect(runtime_dir)  # checks that a daemon answers
    rt = client._client.runtime_dir
    client.close()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.connect(Endpoints(rt).events)
    decoder = msgspec.msgpack.Decoder(TokenOut)
    seen = 0
    try:
        while count is None or seen < count:
            if not sub.poll(1000):
                if not Endpoints(rt).client_path.exists():
                    click.echo("error: the daemon stopped", err=True)
                    sys.exit(3)
                continue
            event = decoder.decode(sub.recv())
            if request_id is not None and event.request_id != request_id:
                continue
            seen += 1
            if as_json:
                click.echo(_event_json(event))
            else:
                click.echo(f"{event.request_id}\t{event.index}\t{event.token_id}\t{event.text!r}")
    except KeyboardInterrupt:
        pass
    finally:
        ctx.destroy(linger=0)


@kvasir.command()
@click.option("--json", "as_json", is_flag=True, help="One JSON object: daemon-wide fields and \"stages\".")
@click.option("--wait", "wait_s", type=float, default=0.0, metavar="SECONDS",
              help="Wait up to SECONDS for the daemon to answer (e.g. right after starting it).")
@RUNTIME_DIR
@remote_options
def stats(as_json, wait_s, runtime_dir, remote) -> None:
    """Per-stage busy / starved / blocked time, batches, rows, tokens; the daemon's state,
    restarts and last failure. CUDA stages also show their device and GPU memory (held
    by tensors / reserved by the allocator)."""
    client = _connect(runtime_dir, wait_s, remote)
    try:
        daemon = client.stats()
    finally:
        client.close()
    body = {f: getattr(daemon, f) for f in daemon.__struct_fields__ if f not in ("stages", "timeline")}
    body["stages"] = [msgspec.structs.asdict(stage) for stage in daemon.stages]
    body = msgspec.to_builtins(body)
    for stage in body["stages"]:
        wall = stage["wall_s"] or 1.0
        for part in ("busy", "starved", "blocked"):
            stage[f"{part}_fraction"] = stage[f"{part}_s"] / wall
    if any(stage["pool"] for stage in body["stages"]):
        body["pools"] = _pool_totals(body["stages"])
    if as_json:
        click.echo(json.dumps(body))
        return
    click.echo(
        f"{body['state']}, uptime {body['uptime_s']:.1f} s, requests {body['requests']}, "
        f"in flight {body['in_flight']}, restarts {body['restarts']}"
    )
    if body["last_failure"] is not None:
        click.echo(f"last failure {body['last_failure_age_s']:.0f} s ago: {body['last_failure']}")
    if body["clients_lost"] or body["client_bytes_waiting"] or body["malformed"]:
        click.echo(
            f"clients given up on {body['clients_lost']} (gone or not reading), events waiting for slow "
            f"clients {_size(body['client_bytes_waiting'])}, malformed internal messages dropped {body['malformed']}"
        )
    if body["handoff"] is not None:
        h = body["handoff"]
        click.echo(
            f"hand-offs {h['count']}, {_size(h['kv_bytes'])} of KV; time p50 {h['p50_s'] * 1000:.2f} ms, "
            f"p99 {h['p99_s'] * 1000:.2f} ms; copies at {h['gibps']:.2f} GiB/s"
        )
    header = ("stage", "layers", "pid", "busy", "starved", "blocked", "batches", "rows", "tokens", "inflight", "kv reqs")
    rows = [header]
    for s in body["stages"]:
        rows.append((
            f"{s['index']} {s['pool']}".rstrip(), f"[{s['layers'][0]}, {s['layers'][1]})", str(s["pid"]),
            f"{s['busy_s']:.1f}s {s['busy_fraction']:.0%}", f"{s['starved_s']:.1f}s {s['starved_fraction']:.0%}",
            f"{s['blocked_s']:.1f}s {s['blocked_fraction']:.0%}", str(s["batches"]), str(s["rows"]),
            str(s["tokens"]), str(s["inflight"]), str(s["kv_requests"]),
        ))
    if any(s["device"] != "cpu" for s in body["stages"]):  # CUDA stages: where, and device memory in use / reserved
        header += ("device", "gpu mem")
        rows = [header] + [
            row + (s["device"], f"{_size(s['gpu_bytes'])} / {_size(s['gpu_reserved_bytes'])}" if s["device"] != "cpu" else "-")
            for row, s in zip(rows[1:], body["stages"])
        ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for r in rows:
        click.echo("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())
    for name, pool in body.get("pools", {}).items():
        click.echo(
            f"{name} pool ({pool['stages']} stages): busy {pool['busy_fraction']:.0%}, "
            f"starved {pool['starved_fraction']:.0%}, blocked {pool['blocked_fraction']:.0%}"
        )


def _pool_totals(stages: list[dict]) -> dict:
    """Busy / starved / blocked per pool: seconds summed over its stages, fractions of their wall time."""
    pools: dict[str, dict] = {}
    for stage in stages:
        pool = pools.setdefault(stage["pool"], {"stages": 0, "wall_s": 0.0, "busy_s": 0.0, "starved_s": 0.0, "blocked_s": 0.0})
        pool["stages"] += 1
        for key in ("wall_s", "busy_s", "starved_s", "blocked_s"):
            pool[key] += stage[key]
    for pool in pools.values():
        wall = pool["wall_s"] or 1.0
        for part in ("busy", "starved", "blocked"):
            pool[f"{part}_fraction"] = pool[f"{part}_s"] / wall
    return pools


@kvasir.command()
@click.option("--interval", type=float, default=1.0, show_default=True, help="Seconds between frames.")
@click.option("--count", type=int, default=None, help="Stop after this many frames (default: until q or Ctrl-C).")
@RUNTIME_DIR
def top(interval, count, runtime_dir) -> None:
    """Live view: per-stage busy / starved / blocked bars, batches in flight, queue, tokens/s.

    Press q (or Ctrl-C) to quit. Exit code 3 when no daemon answers (or it stops answering).
    """
    from kvasir.client import NoDaemon
    from kvasir.top import run_top

    if interval <= 0 or (count is not None and count < 1):
        raise click.UsageError("--interval must be > 0 and --count >= 1")
    client = _connect(runtime_dir)
    try:
        run_top(lambda: client.stats(timeout_s=max(5.0, 3 * interval)), interval, count)
    except (NoDaemon, KvasirError) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(3)
    finally:
        client.close()


@kvasir.group()
def keys() -> None:
    """CURVE keys for the daemon's TCP endpoint."""


@keys.command("generate")
@click.argument("folder", type=click.Path(file_okay=False))
@click.option("--client", "clients", multiple=True, default=None, metavar="NAME",
              help="Make a client key pair called NAME (repeatable; default: one called 'client').")
def keys_generate(folder: str, clients: tuple[str, ...]) -> None:
    """Make key pairs in FOLDER: the daemon's (server.key, server.key_secret; kept if it
    exists) and each client's (NAME.key, NAME.key_secret, with NAME.key also copied into
    FOLDER/clients/, the allow-list a plan names as bridge.client_keys). Secret files are
    mode 0600. Never overwrites a key."""
    from kvasir.keys import generate as generate_keys

    try:
        made = generate_keys(Path(folder), list(clients) or ["client"])
    except KvasirError as exc:
        _fail(exc)
    for path in made:
        click.echo(str(path))


if __name__ == "__main__":  # python -m kvasir.cli (scripts/gpu-check, with any interpreter)
    kvasir()
