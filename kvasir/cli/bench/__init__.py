"""``kvasir bench``: load a daemon, or measure this machine, and report; one subcommand
per mode (kvasir/bench/modes.py), all built on the shared options of
kvasir/cli/bench/options.py."""

from __future__ import annotations

import click

from kvasir.cli.bench.checks import quality
from kvasir.cli.bench.contests import compare, plans, pool
from kvasir.cli.bench.probes import hop, roofline
from kvasir.cli.bench.runs import doors, failover, isolation, load, submit, sweep

# the flags of the single command before the subcommands, and where each went
MOVED = {
    "--compare": "compare (or plans, for two --plan)",
    "--rate-sweep": "sweep",
    "--submit-only": "submit",
    "--hop": "hop",
    "--roofline": "roofline",
    "--failover": "failover",
    "--doors": "doors URL",
}


class BenchGroup(click.Group):
    """Subcommands, with a pointer from the old mode flags to the subcommand that took each over."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        for arg in args:
            if arg in MOVED:
                raise click.UsageError(f"{arg} is now a subcommand: kvasir bench {MOVED[arg]}", ctx)
        if args and args[0].startswith("--") and args[0] not in ("--help", "-h"):
            raise click.UsageError("give a mode first: kvasir bench load|sweep|submit|compare|plans|...", ctx)
        return super().parse_args(ctx, args)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(self.commands)  # as added: the everyday run first


@click.group(cls=BenchGroup)
def bench() -> None:
    """Load a daemon and report throughput, latency percentiles, goodput under SLOs and each
    stage's busy/starved/blocked share, or measure this machine's limits. Each mode is a
    subcommand with its own --help; BENCHMARKS.md and docs/bench/ show each one's use.
    """


for command in (load, sweep, submit, failover, isolation, doors, compare, plans, pool, quality, hop, roofline):
    bench.add_command(command)
