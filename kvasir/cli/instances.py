"""``kvasir instances``: the fleet's instances (pool, state, load, moves); ``kvasir
instances move NAME --to decode|prefill|mixed`` moves one to another pool (docs/planner.md)."""

from __future__ import annotations

import json
import sys
import time

import click
import msgspec

from kvasir.cli.common import RUNTIME_DIR, connect, fail, wait_timeout
from kvasir.cli.table import table_lines
from kvasir.errors import KvasirError
from kvasir.wire.fleet import InstanceStats, MoveTarget, pool_name, target_pool

POLL_S = 0.25  # how often `move` looks at the instance while it waits


@click.group(invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True, help="One JSON array: each instance's fields.")
@RUNTIME_DIR
@click.pass_context
def instances(ctx, as_json, runtime_dir) -> None:
    """Each instance: the pool it serves now, its state (serving, moving, restarting, parked),
    the requests on it, requests routed to it since start, whether it may move (a plan
    with [planner]), its moves and how long the last one took."""
    if ctx.invoked_subcommand is not None:
        ctx.obj = runtime_dir
        return
    client = connect(runtime_dir)
    try:
        listed = client.stats().instances
    finally:
        client.close()
    if as_json:
        click.echo(json.dumps(msgspec.to_builtins(listed)))
        return
    header = ["instance", "pool", "state", "requests", "routed", "movable", "moves", "last move"]
    rows = [header] + [_row(i) for i in listed]
    for line in table_lines(rows):
        click.echo(line)


def _row(i: InstanceStats) -> list[str]:
    state: str = i.state
    if i.move is not None:
        state = f"moving to {i.move.to} ({i.move.phase}, {i.move.seconds:.1f} s)"
    last = f"{i.last_move_s:.1f} s" if i.last_move_s is not None else "-"
    return [
        i.name,
        pool_name(i.pool, i.movable),
        state,
        str(i.requests),
        str(i.routed),
        "yes" if i.movable else "no",
        str(i.moves),
        last,
    ]


@instances.command()
@click.argument("name")
@click.option(
    "--to",
    "to",
    type=click.Choice(["prefill", "decode", "mixed"]),
    required=True,
    help="The pool it is to serve (mixed: both phases, as a colocated ring).",
)
@click.option(
    "--wait/--no-wait",
    default=True,
    help="Wait until it serves in its new pool (default), or return once the move started.",
)
@wait_timeout("the move")
@RUNTIME_DIR
@click.pass_obj
def move(group_dir, name, to, wait, timeout_s, runtime_dir) -> None:
    """Move instance NAME to another pool while the daemon serves: nothing new goes to
    it, its requests finish, its processes restart in the new pool with that pool's
    widths. Exits 1 when the move does not end within --timeout or the instance fails."""
    client = connect(runtime_dir or group_dir)
    try:
        started = client.move(name, to)
        click.echo(f"moving {name} to the {to} pool: waiting for {started.requests} requests on it to finish")
        if wait:
            _wait(client, name, to, timeout_s)
    except KvasirError as exc:
        fail(exc)
    finally:
        client.close()


def _wait(client, name: str, to: MoveTarget, timeout_s: float) -> None:
    """Poll the daemon until the instance serves in ``to``; say each phase once."""
    deadline = time.monotonic() + timeout_s
    said = ""
    while time.monotonic() < deadline:
        instance = next(i for i in client.stats().instances if i.name == name)
        if instance.move is None and instance.pool == target_pool(to) and instance.state == "serving":
            took = f" in {instance.last_move_s:.1f} s" if instance.last_move_s is not None else ""
            click.echo(f"{name} serves the {to} pool: moved{took}")
            return
        if instance.move is None:
            click.echo(
                f"error: {name} did not move: it is {instance.state} in the {pool_name(instance.pool, instance.movable)} pool",
                err=True,
            )
            sys.exit(1)
        if instance.move.phase != said:
            said = instance.move.phase
            click.echo(f"  {said} ({instance.move.seconds:.1f} s, {instance.move.requests} requests on it)")
        time.sleep(POLL_S)
    click.echo(f"error: {name} is still moving after {timeout_s:g} s (the move goes on)", err=True)
    sys.exit(1)
