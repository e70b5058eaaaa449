"""``kvasird start``: the daemon's command line."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click
import msgspec

from kvasir import __version__
from kvasir.cli.common import RUNTIME_DIR, fail
from kvasir.config.plan import default_plan_path
from kvasir.errors import KvasirError
from kvasir.wire.transport import default_runtime_dir


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kvasird")
def kvasird() -> None:
    """The Kvasir daemon."""


@kvasird.command("start")
@click.option(
    "--plan",
    "plan_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="Plan file (default: the built-in two-stage plan for smollm2-135m).",
)
@RUNTIME_DIR
@click.option(
    "--ready-timeout",
    type=float,
    default=300.0,
    show_default=True,
    help="Seconds to wait for every stage to load and report ready.",
)
@click.option(
    "--drain-timeout",
    type=float,
    default=30.0,
    show_default=True,
    help="On SIGTERM/SIGINT, seconds to let running requests finish.",
)
@click.option(
    "--stop-with-parent",
    is_flag=True,
    help="Drain and stop, as on SIGTERM, when the process that started kvasird exits "
    "(kvasir bench starts its daemons so: a killed bench leaves none behind).",
)
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info")
def start(
    plan_path: str | None,
    runtime_dir: str | None,
    ready_timeout: float,
    drain_timeout: float,
    stop_with_parent: bool,
    log_level: str,
) -> None:
    """Serve a plan in the foreground until SIGTERM or SIGINT (then drain and exit 0).

    Validates the plan first (exit 2 on a bad plan, before anything is spawned), makes
    the runtime dir (mode 0700; an existing one must be a real directory of this user
    holding only Kvasir's lock and sockets, else exit 1), spawns one worker per stage
    and the bridge, waits for
    each to report ready, and serves. A worker that dies or hangs ends every request in
    the daemon with stage_failed and the workers are restarted (the plan's [supervise]
    section bounds how often); past that bound the daemon exits 1.
    """
    from kvasir.daemon.host import check_host
    from kvasir.daemon.launcher import Launcher, Timeouts, run_launcher
    from kvasir.daemon.notify import ServiceNotifier
    from kvasir.daemon.resolve import resolve_plan
    from kvasir.logs import setup_logging
    from kvasir.model.convert import ConversionInterrupted, prepare

    path = plan_path or str(default_plan_path())
    try:
        plan, source = resolve_plan(path)
        check_host(plan)
    except KvasirError as exc:
        fail(exc)
    log = setup_logging(log_level, role="launcher", pid=os.getpid())
    try:
        source = prepare(source, log)
        source.require_weights()
    except ConversionInterrupted as exc:
        log.info("stopped during start-up", why=str(exc))
        sys.exit(0)
    except KvasirError as exc:
        fail(exc)
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
