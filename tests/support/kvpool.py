"""The KV pool's tiers made in tests as a stage makes them: a private folder held open,
its health logging into a list."""

from __future__ import annotations

from pathlib import Path

from kvasir.kvpool.disk import DiskTier
from kvasir.kvpool.files import Folder
from kvasir.kvpool.health import TierHealth

SECRET = b"s" * 32


class Events:
    """A logger that keeps what it is told: (level, event, fields)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, dict]] = []

    def _keep(self, level: str):
        return lambda event, **fields: self.seen.append((level, event, fields))

    def __getattr__(self, level: str):
        if level in ("debug", "info", "warning", "error", "exception"):
            return self._keep(level)
        raise AttributeError(level)

    def events(self) -> list[str]:
        return [event for _, event, _ in self.seen]


def make_tier(path: Path, max_bytes: int, tier="disk", log=None, clock=None) -> DiskTier:
    """A tier on the folder ``path`` (made 0700 if missing)."""
    health = TierHealth(tier, str(path), log or Events(), **({"clock": clock} if clock else {}))
    return DiskTier(Folder.root(path, make=True, private=True), max_bytes, health)
