"""Byte sizes: the binary-unit constants and how figures print them."""

from __future__ import annotations


def format_bytes(n: int) -> str:
    """Bytes in binary units: 512 B, 288.0 KiB, 1.5 GiB."""
    if n < 1024:
        return f"{n} B"
    value, unit = n / 1024, "KiB"
    for bigger in ("MiB", "GiB"):
        if value < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{value:.1f} {unit}"
