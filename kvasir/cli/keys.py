"""``kvasir keys generate``: CURVE key pairs for the TCP endpoint and for the hosts of a plan."""

from __future__ import annotations

from pathlib import Path

import click

from kvasir.cli.common import fail
from kvasir.errors import KvasirError


@click.group()
def keys() -> None:
    """CURVE keys for the daemon's TCP endpoint and a plan's hosts."""


@keys.command("generate")
@click.argument("folder", type=click.Path(file_okay=False))
@click.option(
    "--client",
    "clients",
    multiple=True,
    default=None,
    metavar="NAME",
    help="Make a client key pair called NAME (repeatable; default, without --host: one called 'client').",
)
@click.option(
    "--host",
    "hosts",
    multiple=True,
    default=None,
    metavar="NAME",
    help="Make the key pair of the plan's host NAME (repeatable): the FOLDER a plan's cluster.keys names.",
)
@click.option(
    "--pool-secret",
    is_flag=True,
    help="Make the fleet's KV pool secret (FOLDER/kvpool.secret) if FOLDER lacks it (--host makes it too).",
)
def keys_generate(folder: str, clients: tuple[str, ...], hosts: tuple[str, ...], pool_secret: bool) -> None:
    """Make key pairs in FOLDER: with --client (or with no option), the daemon's
    (server.key, server.key_secret; kept if it exists) and each client's (NAME.key,
    NAME.key_secret, with NAME.key also copied into FOLDER/clients/, the allow-list a plan
    names as bridge.client_keys); with --host, each host's (NAME.key, NAME.key_secret:
    copy the secret file to that host only) and, if missing, the KV pool secret
    kvpool.secret that keys the checksum of every slice the pool stores (copy it to every
    host). Secret files are mode 0600. Never overwrites a key."""
    from kvasir.config.keys import generate as generate_keys

    only_secret = pool_secret and not clients and not hosts
    try:
        made = generate_keys(
            Path(folder), list(clients) or ([] if hosts or only_secret else ["client"]), list(hosts), pool_secret
        )
    except KvasirError as exc:
        fail(exc)
    for path in made:
        click.echo(str(path))
