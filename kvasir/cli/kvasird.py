"""``kvasird start``: the daemon's command line."""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from pathlib import Path

import click
import msgspec

from kvasir import __version__
from kvasir.cli.common import RUNTIME_DIR, Seconds, fail
from kvasir.config.plan import default_plan_path, load_plan
from kvasir.daemon.environment import exec_in_worker_env
from kvasir.errors import KvasirError
from kvasir.exits import leave
from kvasir.transport.channels import default_runtime_dir

KEY = click.option(
    "--key",
    type=click.Path(dir_okay=False),
    default=None,
    help="A plan across hosts: this host's secret key (default: KEYS/HOST.key_secret, KEYS the plan's cluster.keys).",
)
LOG_LEVEL = click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info")


def main() -> None:
    """The ``kvasird`` program. ``start`` and ``join`` first run themselves again in the
    workers' environment (kvasir/daemon/environment.py): here, in the program, never in a
    process that calls the commands in-process (click's test runner, a test suite)."""
    if sys.argv[1:2] in (["start"], ["join"]):
        exec_in_worker_env(lambda text: click.echo(f"warning: {text}", err=True))
    kvasird()


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
    type=Seconds(),
    default=300.0,
    show_default=True,
    help="Seconds to wait for every stage to load and report ready.",
)
@click.option(
    "--drain-timeout",
    type=Seconds(zero_ok=True),
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
@KEY
@LOG_LEVEL
def start(
    *,
    plan_path: str | None,
    runtime_dir: str | None,
    ready_timeout: float,
    drain_timeout: float,
    stop_with_parent: bool,
    key: str | None,
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

    A plan with [cluster] runs this as its leader: it waits for `kvasird join` on every
    other host that runs workers, then hands each its workers.
    """
    _parsed_first(plan_path or str(default_plan_path()))
    log = _logging(log_level, "launcher")
    launcher = _launcher(
        plan_path=plan_path,
        runtime_dir=runtime_dir,
        ready_timeout=ready_timeout,
        drain_timeout=drain_timeout,
        stop_with_parent=stop_with_parent,
        key=key,
        log_level=log_level,
        log=log,
    )
    from kvasir.daemon.foreground import run_launcher

    leave(run_launcher(launcher))


def _parsed_first(path: str) -> None:
    """Exit 2 on a plan that does not parse or check by itself, before the imports that
    reading its model needs (torch, transformers: seconds): a bad plan fails at once."""
    try:
        load_plan(path)
    except KvasirError as exc:
        fail(exc)


def _launcher(*, plan_path, runtime_dir, ready_timeout, drain_timeout, stop_with_parent, key, log_level, log):
    """The plan resolved and checked, the zygote forked, the model ready, the launcher made
    (exit 2 for a bad plan, 1 for a model that cannot be made ready)."""
    from kvasir.daemon.host import check_host
    from kvasir.daemon.launcher import Launcher, Timeouts
    from kvasir.daemon.notify import ServiceNotifier
    from kvasir.daemon.remote import Cluster
    from kvasir.daemon.resolve import resolve_plan

    path = plan_path or str(default_plan_path())
    try:
        plan, source = resolve_plan(path)
        check_host(plan)
        cluster = Cluster.of(plan, key)
    except KvasirError as exc:
        fail(exc)
    zygote = _zygote(plan, log)
    with _closed_if_failed(zygote):
        plan, source = _ready_model(plan, source, log)
        return Launcher(
            plan=plan,
            source=source,
            runtime_dir=Path(runtime_dir) if runtime_dir else default_runtime_dir(),
            log=log,
            timeouts=Timeouts(ready_s=ready_timeout, drain_s=drain_timeout),
            log_level=log_level,
            notifier=ServiceNotifier.from_environment(),
            parent_pid=os.getppid() if stop_with_parent else None,
            cluster=cluster,
            zygote=zygote,
        )


@kvasird.command("join")
@click.option("--plan", "plan_path", type=click.Path(dir_okay=False), required=True, help="The leader's plan (a copy).")
@click.option("--host", "host", required=True, help="This host's name in the plan's [hosts].")
@RUNTIME_DIR
@KEY
@LOG_LEVEL
def join(*, plan_path: str, host: str, runtime_dir: str | None, key: str | None, log_level: str) -> None:
    """Run this host's workers of a plan across hosts, for its leader (`kvasird start`).

    Connects to the leader (CURVE, with this host's key), waits to be handed its
    workers, starts and supervises them and reports to the leader. When the leader stops,
    dies (its connection drops and it stays silent for 1.2 s) or cannot be reached for the
    plan's cluster.host_silence_s, the workers are stopped and the follower waits for a
    leader again. Runs until SIGTERM or SIGINT (exit 0);
    exit 2 for a plan or key that does not load here.
    """
    _parsed_first(plan_path)
    from kvasir.daemon.foreground import run_follower

    log = _logging(log_level, "follower")
    follower = _follower(plan_path=plan_path, host=host, runtime_dir=runtime_dir, key=key, log=log)
    leave(run_follower(follower))


def _follower(*, plan_path, host, runtime_dir, key, log):
    """The plan resolved and checked for this host, the zygote forked, the model ready, the
    follower made (exit 2 for a plan or key that does not load here)."""
    from kvasir.daemon.follower import Follower, Local
    from kvasir.daemon.host import check_host
    from kvasir.daemon.notify import ServiceNotifier
    from kvasir.daemon.resolve import resolve_plan
    from kvasir.model.fingerprint import model_identity

    try:
        plan, source = resolve_plan(plan_path)
        if plan.cluster is None or host not in plan.hosts:
            raise KvasirError(
                f"{plan_path}: host {host!r} is not one of the plan's [hosts] ({', '.join(plan.hosts) or 'none'})"
            )
        if host == plan.cluster.leader:
            raise KvasirError(f"host {host} is the plan's leader: run `kvasird start --plan {plan_path}` there")
        check_host(plan, host)
        secret = key or str(Path(plan.cluster.keys or ".") / f"{host}.key_secret")
    except KvasirError as exc:
        fail(exc)
    zygote = _zygote(plan, log)
    with _closed_if_failed(zygote):
        plan, source = _ready_model(plan, source, log)
        model = model_identity(source.weights_dir, plan.model.dtype)
        here = Local(host, Path(runtime_dir) if runtime_dir else default_runtime_dir(), secret, source.name, model)
        try:
            return Follower(plan, here, log, ServiceNotifier.from_environment(), zygote=zygote)
        except KvasirError as exc:  # its keys do not load
            fail(exc)


def _zygote(plan, log):
    """The zygote forked from this process, before the model is made ready (a conversion
    runs torch, whose threads a fork would not keep), for a plan on the CPU only: a plan
    with a GPU stage or shard starts each worker as a fresh interpreter, CUDA never near a
    fork."""
    from kvasir.daemon.children import on_cpu_only, start_zygote

    return start_zygote(log) if on_cpu_only(plan) else None


@contextmanager
def _closed_if_failed(zygote):
    """Close ``zygote`` (None: there is none) if the block fails, exits included."""
    try:
        yield
    except BaseException:
        if zygote is not None:
            zygote.close()
        raise


def _logging(log_level: str, role: str):
    from kvasir.logs import setup_logging

    return setup_logging(log_level, role=role, pid=os.getpid())


def _ready_model(plan, source, log):
    """The model converted (once, into the cache) and its weights present."""
    from kvasir.model.convert import ConversionInterrupted, prepare

    try:
        source = prepare(source, log)
        source.require_weights()
    except ConversionInterrupted as exc:
        log.info("stopped during start-up", why=str(exc))
        sys.exit(0)
    except KvasirError as exc:
        fail(exc)
    plan = msgspec.structs.replace(plan, model=msgspec.structs.replace(plan.model, source=source.name))
    return plan, source
