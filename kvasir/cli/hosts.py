"""``kvasir hosts``: the hosts of a plan across hosts with their instances; ``kvasir hosts
drain NAME`` drains one: its instances finish their requests and park, so its ``kvasird
join`` can stop with nothing lost (docs/planner.md)."""

from __future__ import annotations

import json
import sys
import time

import click

from kvasir.cli.common import RUNTIME_DIR, connect, fail, wait_timeout
from kvasir.cli.table import table_lines
from kvasir.errors import KvasirError
from kvasir.wire.client import DaemonStats

POLL_S = 0.25  # how often `drain` looks at the instances while it waits


def host_rows(stats: DaemonStats) -> list[dict]:
    """Each host that runs instances: its state and its instances' (``kvasir hosts --json``)."""
    found: dict[str, dict[str, str]] = {}
    for instance in stats.instances:
        for host in instance.hosts:
            found.setdefault(host, {})[instance.name] = instance.state
    rows = []
    for host, on in sorted(found.items()):
        states = set(on.values())
        if host in stats.hosts_missing:
            state = "missing"
        elif states == {"parked"}:
            state = "parked"
        else:
            state = "serving" if "serving" in states else "restarting" if "restarting" in states else "moving"
        rows.append({"host": host, "state": state, "instances": on})
    return rows


@click.group(invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True, help="One JSON array: each host, its state and its instances'.")
@RUNTIME_DIR
@click.pass_context
def hosts(ctx, as_json, runtime_dir) -> None:
    """Each host that runs instances (a plan across hosts): serving, moving, restarting,
    missing (its kvasird join is not there), or parked (standby, or drained: its instances
    serve once a kvasird join starts there), and its instances with their states."""
    if ctx.invoked_subcommand is not None:
        ctx.obj = runtime_dir
        return
    client = connect(runtime_dir)
    try:
        rows = host_rows(client.stats())
    finally:
        client.close()
    if as_json:
        click.echo(json.dumps(rows))
        return
    lines = [["host", "state", "instances"]]
    lines += [[r["host"], r["state"], ", ".join(f"{n} ({s})" for n, s in r["instances"].items())] for r in rows]
    for line in table_lines(lines):
        click.echo(line)


@hosts.command()
@click.argument("name")
@click.option("--wait/--no-wait", default=True, help="Wait until its instances are parked (default).")
@wait_timeout("the drain")
@RUNTIME_DIR
@click.pass_obj
def drain(group_dir, name, wait, timeout_s, runtime_dir) -> None:
    """Drain host NAME while the daemon serves: nothing new goes to its instances, their
    requests finish, their processes stop and they park. Then its kvasird join may stop;
    starting one there again brings them back. Refused for the leader, or when a pool
    would be left without enough serving instances. Exits 1 when the drain does not end
    within --timeout or an instance fails meanwhile."""
    client = connect(runtime_dir or group_dir)
    try:
        started = client.drain_host(name)
        click.echo(
            f"draining host {name}: instances {', '.join(started.instances) or '(none serving)'} leave; "
            f"waiting for {started.requests} requests on them to finish"
        )
        if wait:
            _wait(client, name, started.instances, timeout_s)
    except KvasirError as exc:
        fail(exc)
    finally:
        client.close()


def _wait(client, host: str, leaving: list[str], timeout_s: float) -> None:
    """Poll the daemon until every leaving instance is parked."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = {i.name: i for i in client.stats().instances if i.name in leaving}
        if all(i.state == "parked" for i in states.values()):
            click.echo(f"host {host} is drained: its kvasird join may stop (a new one there brings it back)")
            return
        lost = [n for n, i in states.items() if i.state != "parked" and (i.move is None or i.move.to != "parked")]
        if lost:
            click.echo(f"error: {', '.join(lost)} did not park: {states[lost[0]].state}", err=True)
            sys.exit(1)
        time.sleep(POLL_S)
    click.echo(f"error: host {host} is still draining after {timeout_s:g} s (the drain goes on)", err=True)
    sys.exit(1)
