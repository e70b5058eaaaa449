"""Byte sizes: the binary-unit constants, and how figures print them."""

from __future__ import annotations

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30


def format_bytes(n: int) -> str:
    """Bytes in binary units: 512 B, 288.0 KiB, 1.5 GiB."""
    if n < KIB:
        return f"{n} B"
    value, unit = n / KIB, "KiB"
    for bigger in ("MiB", "GiB"):
        if value < KIB:
            break
        value, unit = value / KIB, bigger
    return f"{value:.1f} {unit}"


def gib_per_s(nbytes: float, seconds: float) -> float:
    """A copy rate in GiB/s (0 when no time was measured)."""
    return nbytes / GIB / seconds if seconds > 0 else 0.0
