"""Command line: ``kvasir`` (client side) and ``kvasird`` (the daemon)."""

from __future__ import annotations

import json
import sys

import click

from kvasir import __version__
from kvasir.errors import KvasirError


def _fail(exc: KvasirError) -> None:
    click.echo(f"error: {exc}", err=True)
    sys.exit(2)


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kvasir")
def kvasir() -> None:
    """Kvasir: serve a language model as an in-flight ring of pipeline stages."""


@kvasir.group()
def plan() -> None:
    """Inspect plan files (the TOML that says how a model is split into stages)."""


@plan.command("check")
@click.argument("path", type=click.Path(dir_okay=False, path_type=str))
@click.option("--json", "as_json", is_flag=True, help="Print the resolved plan as one JSON object.")
def plan_check(path: str, as_json: bool) -> None:
    """Validate PATH and print the resolved plan, or exit 2 with the first problem.

    Per stage it shows the layer range, parameter count and bytes, KV cache bytes and
    the boundary slots on the edge into the stage.
    """
    import msgspec

    from kvasir.footprint import plan_footprint
    from kvasir.resolve import resolve_plan

    try:
        resolved, source = resolve_plan(path)
        stages = plan_footprint(resolved, source)
    except KvasirError as exc:
        _fail(exc)
    if as_json:
        body = {
            "plan": msgspec.to_builtins(resolved),
            "model": {
                "name": source.name,
                "architecture": source.config.model_type,
                "layers": source.num_layers,
                "hidden_size": int(source.config.hidden_size),
                "vocab_size": source.vocab_size,
                "weights": str(source.weights_dir) if source.weights_dir else None,
            },
            "stages": [msgspec.to_builtins(s.__dict__) for s in stages],
        }
        click.echo(json.dumps(body))
        return
    _print_plan(path, resolved, source, stages)


def _print_plan(path, resolved, source, stages) -> None:
    m, b, kv = resolved.model, resolved.batch, resolved.kv
    config = source.config
    click.echo(f"plan     {path}")
    click.echo(
        f"model    {source.name} ({config.model_type}, {source.num_layers} layers, hidden "
        f"{config.hidden_size}, vocab {source.vocab_size}), {m.dtype}, max_seq_len {m.max_seq_len}"
    )
    if source.weights_dir is None:
        click.echo("weights  not prepared yet (no converted weights in the cache)")
    click.echo(f"batch    max_rows {b.max_rows}, max_tokens {b.max_tokens}, inflight {b.inflight}")
    click.echo(
        f"kv       {kv.num_blocks} blocks x {kv.block_size} tokens = "
        f"{kv.num_blocks * kv.block_size} tokens per stage"
    )
    click.echo(f"bridge   max_waiting {resolved.bridge.max_waiting}")
    header = ("stage", "role", "layers", "device", "threads", "params", "param bytes", "kv bytes", "boundary in")
    rows = [header]
    for s in stages:
        slots = f"{s.slots} x {_size(s.slot_bytes)}" if s.slots else "-"
        rows.append(
            (
                str(s.index),
                s.role,
                f"[{s.layers[0]}, {s.layers[1]})",
                s.device,
                str(s.threads),
                f"{s.parameters:,}",
                _size(s.parameter_bytes),
                _size(s.kv_bytes),
                slots,
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for r in rows:
        click.echo("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip())


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kvasird")
def kvasird() -> None:
    """The Kvasir daemon (serving arrives with the ring daemon; see README)."""
