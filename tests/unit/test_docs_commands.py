"""Every ``kvasir`` and ``kvasird`` command the README, docs/ (and its pages of benchmarks) and BENCHMARKS.md show
parses as written: its subcommands and options exist and its values convert (a path
that exists only on the machine that ran it is let pass). The e2e tests run the README's
tour and the HTTP page's examples against the default model (test_default_model.py)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import click
import pytest

from kvasir.cli.kvasird import kvasird
from kvasir.cli.main import kvasir

ROOT = Path(__file__).parents[2]
PAGES = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").rglob("*.md"))]
PROGRAMS = {"kvasir": kvasir, "kvasird": kvasird}
COMMAND = re.compile(r"^(?:    |\+ )\s*(?:\.venv/bin/|\$BIN/)?(kvasird?) (.+)$")


def shown_commands() -> list[tuple[str, str, tuple[str, ...]]]:
    """(page:line, program, arguments) of every command line shown in a code block or run transcript."""
    found = []
    for page in PAGES:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            match = COMMAND.match(line)
            if match:
                words = shlex.split(match.group(2).rstrip("\\"), comments=True)
                words = [w for w in _first_command(words) if not w.startswith("(")]  # "(x2)"-style notes
                found.append((f"{page.name}:{number}", match.group(1), tuple(words)))
    return found


def _first_command(words: list[str]) -> list[str]:
    """The words up to the first shell operator (``&``, ``|``, ``>``, ``;``, ``&&``)."""
    for i, word in enumerate(words):
        if word in {"&", "|", ">", ";", "&&", "2>&1"}:
            return words[:i]
        if word.endswith(";"):
            return [*words[:i], word[:-1]]
    return words


def parse(program: click.Command, args: list[str], parent: click.Context | None = None, name: str = "") -> None:
    """Parse ``args`` as ``program`` would, down through its subcommands, without running anything."""
    ctx = program.make_context(name or program.name or "", list(args), parent=parent)
    if isinstance(program, click.Group):
        rest = [*ctx._protected_args, *ctx.args]
        if not rest and program.invoke_without_command:  # a group that runs alone (`kvasir instances`)
            return
        assert rest, f"{name or program.name}: no subcommand"
        sub_name, sub, sub_args = program.resolve_command(ctx, rest)
        assert sub is not None and sub_name is not None
        parse(sub, sub_args, ctx, sub_name)


COMMANDS = shown_commands()


def test_the_pages_show_commands():
    assert len(COMMANDS) > 40 and {program for _, program, _ in COMMANDS} == {"kvasir", "kvasird"}


@pytest.mark.parametrize("where, program, args", COMMANDS, ids=[where for where, _, _ in COMMANDS])
def test_every_shown_command_parses(where, program, args):
    try:
        parse(PROGRAMS[program], list(args))
    except click.BadParameter as exc:
        if "does not exist" not in exc.format_message():
            pytest.fail(f"{where}: {program} {shlex.join(args)}: {exc.format_message()}")
    except click.UsageError as exc:
        pytest.fail(f"{where}: {program} {shlex.join(args)}: {exc.format_message()}")
