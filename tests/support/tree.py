"""Scans of the package's source lines (tests that forbid a construct everywhere)."""

from __future__ import annotations

import re
from pathlib import Path

PACKAGE = Path(__file__).parents[2] / "kvasir"


def lines_matching(pattern: re.Pattern[str], skip: tuple[str, ...] = ()) -> list[str]:
    """``path:line: text`` of every package line ``pattern`` finds, files named in ``skip`` aside."""
    sources = sorted(PACKAGE.rglob("*.py"))
    assert len(sources) > 20  # the scan found the package
    return [
        f"{path.relative_to(PACKAGE.parent)}:{number}: {line.strip()}"
        for path in sources
        if path.name not in skip
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
