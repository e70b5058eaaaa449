"""Plain-text tables for the commands that print them (``kvasir stats``, ``kvasir plan check``)."""

from __future__ import annotations

from collections.abc import Sequence


def table_lines(rows: Sequence[Sequence[str]], indent: str = "") -> list[str]:
    """Rows of cells (the first is the header) as left-aligned columns two spaces apart,
    trailing blanks trimmed."""
    if not rows:
        return []
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
