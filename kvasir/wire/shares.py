"""Where a stage's time went: the one definition of its busy, starved and blocked shares.

A stage counts its wall time as busy (running a batch), starved (nothing to run) or
blocked (an output ready and no free slot downstream); ``StageStats`` carries the three
totals in seconds since the stage started, with ``wall_s``. A share is seconds over wall
seconds, for the stage's whole life or for a window between two reports of the same
process. A pool's (or the whole ring's) shares add up its stages' seconds before
dividing, so each stage counts in proportion to its wall seconds: for stages measured
over the same window that is their mean. An expert shard (``ShardStats``) counts its
time the same way. ``kvasir stats``, ``kvasir top`` and ``kvasir bench`` all print these,
and a mixture-of-experts stage's expert load (``imbalance``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvasir.wire.stats import ShardStats, StageStats

PARTS = ("busy", "starved", "blocked")


@dataclass(frozen=True)
class Shares:
    """Seconds of wall time, and how many of them were busy, starved and blocked."""

    wall_s: float = 0.0
    busy_s: float = 0.0
    starved_s: float = 0.0
    blocked_s: float = 0.0

    def fraction(self, part: str) -> float:
        """``part`` ("busy", "starved" or "blocked") as a share of the wall time (0 without any)."""
        seconds = {"busy": self.busy_s, "starved": self.starved_s, "blocked": self.blocked_s}[part]
        return seconds / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def busy(self) -> float:
        return self.fraction("busy")

    @property
    def starved(self) -> float:
        return self.fraction("starved")

    @property
    def blocked(self) -> float:
        return self.fraction("blocked")

    def __add__(self, other: Shares) -> Shares:
        return Shares(
            self.wall_s + other.wall_s,
            self.busy_s + other.busy_s,
            self.starved_s + other.starved_s,
            self.blocked_s + other.blocked_s,
        )


def stage_shares(now: StageStats | ShardStats, before: StageStats | ShardStats | None = None) -> Shares:
    """A stage's (or shard's) seconds since it started, or over the window since
    ``before`` (an earlier report of the same process)."""
    if before is None:
        return Shares(now.wall_s, now.busy_s, now.starved_s, now.blocked_s)
    return Shares(
        now.wall_s - before.wall_s,
        now.busy_s - before.busy_s,
        now.starved_s - before.starved_s,
        now.blocked_s - before.blocked_s,
    )


def total(shares: Iterable[Shares]) -> Shares:
    """A pool's or the ring's shares: its stages' seconds summed (weighted by seconds)."""
    out = Shares()
    for one in shares:
        out = out + one
    return out


def by_pool(stages: Iterable[tuple[str, Shares]]) -> dict[str, Shares]:
    """Each pool's total, keyed by pool name ("" in a colocated plan), in first-seen order."""
    pools: dict[str, list[Shares]] = {}
    for pool, shares in stages:
        pools.setdefault(pool, []).append(shares)
    return {pool: total(members) for pool, members in pools.items()}


def imbalance(tokens: Sequence[int]) -> float:
    """Expert load: the busiest expert's tokens over the mean (1.0: even; 0 with none)."""
    mean = sum(tokens) / len(tokens) if tokens else 0.0
    return max(tokens) / mean if mean > 0 else 0.0


def window(now: Sequence[int], before: Sequence[int] | None) -> list[int]:
    """Per-expert tokens over a window (``before``: the earlier report, same process)."""
    if before is None or len(before) != len(now):
        return list(now)
    return [a - b for a, b in zip(now, before)]
