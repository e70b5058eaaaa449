"""What the client commands share: the runtime-dir and remote options, connecting, errors."""

from __future__ import annotations

import functools
import json
import math
import sys
from pathlib import Path

import click
import msgspec

from kvasir.errors import KvasirError

RUNTIME_DIR = click.option(
    "--runtime-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="The daemon's runtime dir (default: $KVASIR_RUNTIME_DIR, else $XDG_RUNTIME_DIR/kvasir, else /tmp/kvasir-$UID).",
)


MAX_SECONDS = 86_400.0  # a day: a longer wait is a mistake, not a plan


class Seconds(click.ParamType):
    """A finite number of seconds up to a day; above zero unless ``zero_ok``."""

    name = "seconds"

    def __init__(self, zero_ok: bool = False) -> None:
        self.zero_ok = zero_ok

    def convert(self, value, param, ctx) -> float:
        try:
            seconds = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number of seconds", param, ctx)
        low = "0 <=" if self.zero_ok else "0 <"
        if not math.isfinite(seconds) or seconds < 0 or (seconds == 0 and not self.zero_ok) or seconds > MAX_SECONDS:
            self.fail(f"{value!r} is not within {low} SECONDS <= {MAX_SECONDS:.0f}", param, ctx)
        return seconds


def wait_timeout(what: str):
    """``--timeout SECONDS`` (``timeout_s``) of a command that waits for ``what`` to end."""
    return click.option(
        "--timeout",
        "timeout_s",
        type=float,
        default=600.0,
        show_default=True,
        metavar="SECONDS",
        help=f"With --wait: give up waiting ({what} goes on) after this long.",
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
            remote = Remote(
                endpoint, Path(client_key) if client_key else None, Path(server_key) if server_key else None
            )
        return command(*args, remote=remote, **kwargs)

    for option in (
        click.option(
            "--server-key",
            type=click.Path(dir_okay=False),
            envvar="KVASIR_SERVER_KEY",
            help="With --connect: the daemon's public key file (server.key).",
        ),
        click.option(
            "--key",
            "client_key",
            type=click.Path(dir_okay=False),
            envvar="KVASIR_KEY",
            help="With --connect: this client's key pair (NAME.key_secret from `kvasir keys generate`).",
        ),
        click.option(
            "--connect",
            "endpoint",
            metavar="tcp://HOST:PORT",
            envvar="KVASIR_CONNECT",
            help="Talk to the daemon's TCP endpoint (the plan's bridge.tcp) instead of its runtime dir.",
        ),
    ):
        wrapper = option(wrapper)
    return wrapper


def fail(exc: KvasirError) -> None:
    click.echo(f"error: {exc}", err=True)
    sys.exit(2)


# -- client commands -------------------------------------------------------------------------
def connect(runtime_dir: str | None, wait_s: float = 0.0, remote=None):
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


def event_json(event) -> str:
    return json.dumps(msgspec.to_builtins(event))
