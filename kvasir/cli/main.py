"""``kvasir``: the client-side command line, one module per command (``kvasird`` is in
kvasir/cli/kvasird.py)."""

from __future__ import annotations

import click

from kvasir import __version__
from kvasir.cli.bench import bench
from kvasir.cli.generate import generate
from kvasir.cli.hosts import hosts
from kvasir.cli.instances import instances
from kvasir.cli.keys import keys
from kvasir.cli.model import model
from kvasir.cli.plan import plan
from kvasir.cli.stats import stats
from kvasir.cli.tail import tail
from kvasir.cli.top import top


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kvasir")
def kvasir() -> None:
    """Kvasir: serve a language model as an in-flight ring of pipeline stages."""


for command in (plan, model, generate, tail, stats, top, instances, hosts, keys, bench):
    kvasir.add_command(command)
