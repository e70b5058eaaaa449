"""``kvasir bench hop | roofline``: this machine's limits, measured without a daemon."""

from __future__ import annotations

import json
import re
from pathlib import Path

import click

from kvasir.cli.bench.options import reporting

JSON = click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")


@click.command()
@click.option(
    "--device",
    default="cpu",
    show_default=True,
    help="'cpu' (shared-memory slots) or 'cuda:N' (both processes on that GPU, CUDA IPC slots).",
)
@click.option(
    "--link",
    type=click.Choice(["local", "tcp"]),
    default="local",
    show_default=True,
    help="'tcp' measures the edge between two hosts (boundary as a frame after its descriptor, CURVE) over "
    "loopback TCP; cpu only.",
)
@click.option(
    "--iterations",
    type=click.IntRange(1, 100_000),
    default=400,
    show_default=True,
    help="Measured hand-offs (and round trips, and copies) per size, after 20 warm-up ones; the medians.",
)
@JSON
@reporting
def hop(device, link, iterations, as_json):
    """Measure one stage-to-stage hand-off next to memcpy and ZMQ round trips, at 1 to 512 tokens.

    Exit code: 0 done, 2 bad arguments.
    """
    if link == "tcp" and device != "cpu":
        raise click.UsageError("--link tcp measures a cpu edge: leave out --device")
    checked = _hop_device(device)  # before the bench's imports: a bad argument is refused at once
    from kvasir.bench.hop import hop_report, print_hop

    report = hop_report(iterations, device=checked, link=link)
    click.echo(json.dumps(report)) if as_json else print_hop(report, click.echo)


@click.command()
@click.option(
    "--plan", type=click.Path(dir_okay=False, exists=True), default=None, help="Its model's shapes (default plan's)."
)
@JSON
@reporting
def roofline(plan, as_json):
    """Measure this machine's limits: memory bandwidth (copy, triad) and float32
    matrix-product GFLOP/s at the model's shapes, with 1 and 2 threads.

    Exit code: 0 done, 2 bad arguments.
    """
    from kvasir.bench.roofline import print_roofline, roofline_report
    from kvasir.config.plan import default_plan_path
    from kvasir.daemon.resolve import resolve_plan

    _, source = resolve_plan(Path(plan) if plan is not None else default_plan_path())
    report = roofline_report(source)
    click.echo(json.dumps(report)) if as_json else print_roofline(report, click.echo)


def _hop_device(device: str) -> str:
    """--device checked: "cpu", or a CUDA device that is here."""
    if device == "cpu":
        return device
    if not re.fullmatch(r"cuda(:[0-9]+)?", device):
        raise click.BadParameter(f"{device!r} is not 'cpu' or 'cuda:N'", param_hint="--device")
    import torch

    from kvasir.config.devices import cuda_ordinal

    if not torch.cuda.is_available():
        raise click.BadParameter(f"{device}: CUDA is not available here", param_hint="--device")
    ordinal = cuda_ordinal(device) or 0  # the pattern above: cuda or cuda:N
    if ordinal >= torch.cuda.device_count():
        raise click.BadParameter(
            f"{device}: this machine has {torch.cuda.device_count()} CUDA devices", param_hint="--device"
        )
    return f"cuda:{ordinal}"
