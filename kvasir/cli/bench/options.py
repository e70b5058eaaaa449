"""The options every ``kvasir bench`` subcommand builds on, each group turned into one
value before the command runs: ``target`` (``--plan``, ``--runtime-dir``, ``--json``),
``workload`` (``--requests`` ... ``--ignore-eos``) and ``slo`` (``--slo-*``)."""

from __future__ import annotations

import functools
import signal
import sys
from dataclasses import replace
from pathlib import Path
from typing import get_args

import click

from kvasir.bench.options import Slo, Target
from kvasir.bench.workload import LengthSpec, Workload
from kvasir.errors import KvasirError
from kvasir.wire.base import Grammar, GrammarKind

PROMPT_LEN_HELP = (
    "Prompt tokens: N, LOW:HIGH (uniform), N,N,... (drawn from the list: 1000,40,40,40 mixes long prompts "
    "into chats) or lognormal:MEDIAN:SIGMA:LOW:HIGH (heavy-tailed like chat traffic, e.g. "
    "lognormal:96:0.9:8:1024); shared:N+SPEC starts every prompt with the same N tokens (a system prompt: "
    "shared:1000+40), shared:NxK+SPEC with one of K different ones (K tenants: shared:1000x8+40)."
)
TURNS_HELP = (
    "Multi-turn conversations of N turns: each later turn resends the conversation so far (earlier prompts and "
    "replies) and adds --prompt-len new tokens; a closed loop keeps conversations in flight, an open loop "
    "starts --rate conversations a second. --requests and --warmup count turns."
)


def _apply(command, options):
    for option in reversed(options):
        command = option(command)
    return command


def target_options(plan: bool = True):
    """--plan (a private daemon started for the run), --runtime-dir, --json: passed on as ``target``."""
    options = [click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")]
    options.append(
        click.option(
            "--runtime-dir",
            type=click.Path(file_okay=False),
            default=None,
            help="The daemon's runtime dir (default as for every command; ignored with --plan).",
        )
    )
    if plan:
        options.append(
            click.option(
                "--plan",
                type=click.Path(dir_okay=False, exists=True),
                default=None,
                help="Start a daemon from this plan for the run (private runtime dir) and stop it after.",
            )
        )

    def decorate(command):
        @functools.wraps(command)
        def wrapper(*args, as_json, runtime_dir, plan=None, **kwargs):
            target = Target(Path(plan) if plan else None, Path(runtime_dir) if runtime_dir else None, as_json)
            return command(*args, target=target, **kwargs)

        return _apply(wrapper, options)

    return decorate


def _workload_options(counts: bool, turns: bool) -> list:
    """The workload's click options, in the order --help lists them."""
    options = []
    if counts:
        options += [
            click.option("--requests", "count", type=int, default=64, show_default=True, help="Measured requests."),
            click.option("--warmup", type=int, default=8, show_default=True, help="Requests run first, not measured."),
        ]
    options += [
        click.option("--prompt-len", default="128", show_default=True, help=PROMPT_LEN_HELP),
        click.option(
            "--output-len",
            default="64",
            show_default=True,
            help="Output tokens: N, LOW:HIGH, N,N,... or lognormal:MEDIAN:SIGMA:LOW:HIGH.",
        ),
    ]
    if turns:
        options.append(click.option("--turns", type=int, default=1, show_default=True, help=TURNS_HELP))
    options += [
        click.option(
            "--prompts",
            "prompts_file",
            type=click.Path(dir_okay=False, exists=True),
            default=None,
            help='JSONL file, one {"prompt": ...} or {"token_ids": [...]} per line (instead of random ids).',
        ),
        click.option("--seed", type=int, default=0, show_default=True),
        click.option("--ignore-eos", is_flag=True, help="Every request produces exactly its output length."),
        click.option(
            "--temperature",
            type=click.FloatRange(min=0.0, max=100.0),
            default=0.0,
            show_default=True,
            help="Sample at this temperature instead of greedy (each request seeded from --seed: the same "
            "tokens on every plan and round).",
        ),
        click.option(
            "--structured",
            metavar="KIND:TEXT",
            help="Every request keeps to a structured output: json, json_object, regex, choice or grammar, "
            "then its text (@FILE reads it from a file), e.g. 'json:@schema.json', 'regex:[a-z]+'.",
        ),
    ]
    return options


def _structured(spec: str | None) -> Grammar | None:
    """``--structured KIND:TEXT`` (TEXT from a file with @FILE) as a Grammar."""
    if spec is None:
        return None
    kind, _, text = spec.partition(":")
    if kind not in get_args(GrammarKind):
        raise click.UsageError(f"--structured: KIND is one of {', '.join(get_args(GrammarKind))}, got {kind!r}")
    if text.startswith("@"):
        try:
            text = Path(text[1:]).read_text()
        except OSError as exc:
            raise click.UsageError(f"--structured: cannot read {text[1:]}: {exc}") from None
    return Grammar(kind, text)  # type: ignore[arg-type]


def workload_options(counts: bool = True, turns: bool = True):
    """--requests, --warmup, --prompt-len, --output-len, --turns, --prompts, --seed,
    --ignore-eos, --structured, --temperature: passed on as ``workload`` (counts and turns left out where a mode has none)."""
    options = _workload_options(counts, turns)

    def decorate(command):
        @functools.wraps(command)
        def wrapper(*args, prompt_len, output_len, prompts_file, seed, ignore_eos, structured, temperature, **kwargs):
            count, warmup = kwargs.pop("count", 1), kwargs.pop("warmup", 0)
            lengths = _lengths(prompt_len, output_len, kwargs.pop("turns", 1), count, warmup)
            if lengths[0].turns > 1 and prompts_file:
                raise click.UsageError("--turns sends random-id conversations: not with --prompts")
            if count < 1 or warmup < 0:
                raise click.UsageError("--requests must be positive, --warmup >= 0")
            grammar = _structured(structured)
            workload = Workload(count, warmup, lengths, prompts_file, seed, ignore_eos, grammar, temperature)
            return command(*args, workload=workload, **kwargs)

        return _apply(wrapper, options)

    return decorate


def _lengths(prompt_len: str, output_len: str, turns: int, count: int, warmup: int):
    try:
        prompts, outputs = LengthSpec.parse(prompt_len), LengthSpec.parse(output_len)
    except KvasirError as exc:
        raise click.UsageError(str(exc)) from None
    if outputs.shared:
        raise click.UsageError("--output-len takes no shared: prefix (that is for prompts)")
    if turns < 1 or count % turns or warmup % turns:
        raise click.UsageError("--turns must be >= 1 and divide --requests and --warmup (whole conversations)")
    return replace(prompts, turns=turns), outputs


def slo_options(required: bool = False):
    """--slo-ttft, --slo-tpot, --slo-attain: passed on as ``slo`` (None when no targets are given)."""
    options = [
        click.option("--slo-ttft", type=float, default=None, help="Target time to first token, seconds."),
        click.option("--slo-tpot", type=float, default=None, help="Target time per output token, seconds."),
        click.option(
            "--slo-attain",
            type=float,
            default=0.9,
            show_default=True,
            help="Share of requests that must meet both targets for a rate to count as goodput.",
        ),
    ]

    def decorate(command):
        @functools.wraps(command)
        def wrapper(*args, slo_ttft, slo_tpot, slo_attain, **kwargs):
            if (slo_ttft is None) != (slo_tpot is None):
                raise click.UsageError("give both --slo-ttft and --slo-tpot, or neither")
            if required and slo_ttft is None:
                raise click.UsageError("a goodput search needs --slo-ttft and --slo-tpot")
            if not 0 < slo_attain <= 1 or any(t is not None and not t > 0 for t in (slo_ttft, slo_tpot)):
                raise click.UsageError("--slo-ttft and --slo-tpot must be positive, --slo-attain in (0, 1]")
            slo = Slo(slo_ttft, slo_tpot, slo_attain) if slo_ttft is not None and slo_tpot is not None else None
            return command(*args, slo=slo, **kwargs)

        return _apply(wrapper, options)

    return decorate


def reporting(command):
    """Runs a subcommand with bench's exit codes: 0 done, 1 a daemon it started failed,
    2 bad arguments, 3 no daemon answers; SIGTERM unwinds like Ctrl-C, so a daemon the run
    started is stopped on the way out."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        from kvasir.bench.daemon import BenchDaemonError
        from kvasir.client import NoDaemon

        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        try:
            return command(*args, **kwargs)
        except NoDaemon as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(3)
        except KvasirError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(1 if isinstance(exc, BenchDaemonError) else 2)

    return wrapper


def positive(name: str, value: float | None) -> None:
    if value is not None and not value > 0:
        raise click.UsageError(f"{name} must be positive")
