"""``kvasir model prepare`` and ``kvasir model list``: the converted-model cache."""

from __future__ import annotations

import sys

import click

from kvasir.cli.common import fail
from kvasir.errors import KvasirError
from kvasir.units import format_bytes


@click.group()
def model() -> None:
    """Prepare and list models in the cache ($KVASIR_CACHE_DIR, else ~/.cache/kvasir)."""


@model.command("prepare")
@click.argument("source", default="smollm2-135m")
def model_prepare(source: str) -> None:
    """Convert SOURCE (a built-in alias or a .gguf file) into the cache, once.

    Later loads read the converted safetensors folder; each stage reads only its own
    tensors. A folder that is already a Hugging Face model needs no preparing.
    """
    from kvasir.model.convert import ConversionInterrupted, prepare
    from kvasir.model.source import resolve_source

    try:
        prepared = prepare(resolve_source(source))
    except ConversionInterrupted as exc:
        click.echo(f"kvasir: {exc}", err=True)
        sys.exit(1)
    except KvasirError as exc:
        fail(exc)
    click.echo(f"{source}: ready in {prepared.weights_dir}")


@model.command("list")
def model_list() -> None:
    """Show the built-in models and the converted folders in the cache."""
    from kvasir.model.source import BUILTIN_CONFIGS, cache_dir

    root = cache_dir()
    click.echo(f"cache {root}")
    # names starting with "." are conversions in progress (or killed): never listed or used
    folders = (
        sorted(p for p in root.iterdir() if not p.name.startswith(".") and (p / "config.json").is_file())
        if root.is_dir()
        else []
    )
    names = {p.name for p in folders}
    for alias in sorted(BUILTIN_CONFIGS):
        state = "prepared" if alias in names else "not prepared (kvasir model prepare " + alias + ")"
        click.echo(f"  {alias:<24} built-in, {state}")
    for folder in folders:
        if folder.name not in BUILTIN_CONFIGS:
            size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
            click.echo(f"  {folder.name:<24} converted, {format_bytes(size)}")
