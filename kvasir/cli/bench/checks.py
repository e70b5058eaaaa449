"""``kvasir bench quality``: the served model's perplexity and greedy tokens against a
reference on the same file (kvasir/bench/quality.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from kvasir.bench.options import Target
from kvasir.cli.bench.options import positive, reporting

FAILED_CHECK = 4  # the exit code when the run went through and a check did not hold


@click.command()
@click.option(
    "--plan",
    type=click.Path(dir_okay=False, exists=True),
    default=None,
    help="The plan to check (a private daemon started from it); default: the default plan.",
)
@click.option(
    "--reference",
    default="llama.cpp",
    show_default=True,
    help='"llama.cpp" (llama-perplexity and llama-server on the model\'s GGUF file), or the path of a second '
    "plan of the same model (e.g. float32 dequantised).",
)
@click.option(
    "--llama-server",
    "llama_server",
    type=click.Path(dir_okay=False),
    default=None,
    help="llama-server (llama-perplexity next to it), found as bench compare finds it when not given.",
)
@click.option("--chars", type=int, default=40_000, show_default=True, help="Characters of the text scored.")
@click.option("--n-ctx", type=int, default=512, show_default=True, help="Tokens per perplexity chunk.")
@click.option("--prompts", type=int, default=16, show_default=True, help="Greedy prompts cut from the text.")
@click.option("--prompt-len", type=int, default=64, show_default=True, help="Tokens per greedy prompt.")
@click.option("--new-tokens", type=int, default=32, show_default=True, help="Greedy tokens per prompt.")
@click.option("--ppl-margin", type=float, default=0.02, show_default=True, help="Perplexity within this share.")
@click.option("--min-agreement", type=float, default=0.90, show_default=True, help="Top-1 agreement at least.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
@reporting
def quality(*, plan, reference, llama_server, as_json, **sizes):
    """Check the model a plan serves against a reference on the same model: the perplexity
    of a fixed text (the standard library's pydoc topics; llama.cpp's scheme, chunks of
    --n-ctx tokens scored on their second halves) and the top-1 agreement of greedy tokens
    (at each token the plan generates from --prompts prompts, the reference's most likely
    next token given the same tokens before). The reference is llama.cpp on the model's
    GGUF file (build it with scripts/llama-server) or a second plan.

    Exit code: 0 both checks held, 1 a daemon or llama.cpp it started failed, 2 bad
    arguments, 4 a check did not hold.
    """
    from kvasir.bench.quality import QualitySpec, run_quality
    from kvasir.config.plan import default_plan_path

    if reference != "llama.cpp" and not Path(reference).is_file():
        raise click.UsageError(f"--reference is llama.cpp or a plan file, and {reference} is neither")
    for name in ("chars", "n_ctx", "prompts", "prompt_len", "new_tokens"):
        positive(f"--{name.replace('_', '-')}", sizes[name])
    target = Target(as_json=as_json)
    report = run_quality(
        Path(plan) if plan else default_plan_path(),
        QualitySpec(**sizes),
        reference=reference,
        llama_server=llama_server,
        say=target.say,
    )
    if as_json:
        click.echo(json.dumps(report))
    else:
        from kvasir.bench.report import print_quality

        print_quality(report, click.echo)
    if not report["checks"]["passed"]:
        sys.exit(FAILED_CHECK)
