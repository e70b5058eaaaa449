"""How a ``kvasir bench`` subcommand ends: its pictures drawn, its report printed."""

from __future__ import annotations

import json
from pathlib import Path

import click

from kvasir.bench.options import Target
from kvasir.errors import KvasirError

PLOT = click.option(
    "--plot",
    "plot_dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Write timeline.png, stages.png and latency.png into this folder.",
)


def finish(target: Target, report: dict, pictures=(), plot_dir: str | None = None, printer=None) -> None:
    """Draw ``pictures`` into ``plot_dir`` (if given), then print the report as JSON or text."""
    if plot_dir is not None:
        from kvasir.bench.plot import plot_run

        if not pictures:
            raise KvasirError("--plot: no ring run to draw (add ring or drained to --contenders)")
        report["plots"] = [str(p) for p in plot_run(list(pictures), Path(plot_dir))]
    if target.as_json:
        click.echo(json.dumps(report))
        return
    if printer is None:
        from kvasir.bench.report import print_report as printer
    printer(report, click.echo)
