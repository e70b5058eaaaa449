"""The fleet as ``kvasir stats`` shows it: each instance, its moves between pools, and the
planner's decisions (kvasir/bridge/moves.py, kvasir/bridge/planner.py)."""

from __future__ import annotations

from typing import Literal

import msgspec

from kvasir.config.sections import Pool
from kvasir.wire.stats import PrefixCounters

MovablePool = Literal["prefill", "decode"]
MoveTarget = Literal["prefill", "decode", "mixed"]  # mixed: both phases on the instance, as a colocated ring
MoveTo = Literal["prefill", "decode", "mixed", "parked"]  # parked: its host is drained (kvasir hosts drain)
MovePhase = Literal["finishing", "retiring", "regrouping", "parking"]


def target_pool(to: MoveTarget) -> Pool:
    """The pool an instance moved to ``to`` serves ("": mixed, which runs as a colocated ring)."""
    return "" if to == "mixed" else to


def pool_name(pool: Pool, movable: bool) -> str:
    """A pool as ``kvasir instances`` shows it: a movable instance's "" is the mixed role."""
    return pool or ("mixed" if movable else "-")


PlannerAction = Literal["move", "hold"]


class MoveState(msgspec.Struct, frozen=True, kw_only=True):
    """An instance's move to another pool, while it lasts (kvasir/bridge/moves.py)."""

    to: MoveTo
    phase: MovePhase  # its requests run out; its head empties; it regroups in the new pool (or parks)
    seconds: float  # since the move was decided
    requests: int  # still on it


class InstanceStats(msgspec.Struct, frozen=True, kw_only=True):
    """One instance as the bridge sees it (kvasir/bridge/heads.py)."""

    name: str
    pool: Pool  # the pool it serves now
    state: Literal["serving", "restarting", "moving", "parked"]  # parked: its standby or drained host is away
    stages: list[int]  # its stages' global indices
    hosts: list[str] = []  # the hosts its workers run on (a plan across hosts)
    restarts: int = 0
    last_failure: str | None = None
    requests: int = 0  # the bridge's requests on it now (an admitting instance's)
    routed: int = 0  # requests the conductor sent to it since the daemon started
    backlog: int = 0  # prompt tokens routed to it still waiting for their first token (less the cached)
    prefix: PrefixCounters | None = None  # its head's prefix cache
    movable: bool = False  # it may move to another pool (a plan with [planner])
    moves: int = 0  # moves it made since the daemon started
    move: MoveState | None = None  # the move under way
    last_move_s: float | None = None  # its last move: from the decision to serving in the new pool

    @property
    def hit_rate(self) -> float:
        cache = self.prefix
        return cache.hit_tokens / cache.prompt_tokens if cache is not None and cache.prompt_tokens else 0.0


class PlannerDecision(msgspec.Struct, frozen=True, kw_only=True):
    """One of the planner's decisions, with what it read (kvasir/bridge/planner.py)."""

    action: PlannerAction
    reason: str
    seconds_ago: float = 0.0  # when it was made, before the stats query
    ttft_s: float | None = None  # the interval's time to first token at the percentile (None: no sample)
    itl_s: float | None = None  # its inter-token latency at the percentile
    prefill: int = 0  # serving prefill instances, none moving
    decode: int = 0  # serving decode instances
    prefill_busy: float | None = None  # the prefill pool's busy share in the interval (None: not measured)
    decode_busy: float | None = None  # the decode pool's
    instance: str | None = None  # a move: the instance it moves
    to: MovablePool | None = None  # and where

    def describe(self) -> str:
        """One line: what, why, on which readings, how long ago."""
        what = f"move {self.instance} to {self.to}" if self.action == "move" else "hold"
        ttft = f"{self.ttft_s:.3g} s" if self.ttft_s is not None else "-"
        itl = f"{self.itl_s:.3g} s" if self.itl_s is not None else "-"
        busy = "/".join(f"{b:.2f}" if b is not None else "-" for b in (self.prefill_busy, self.decode_busy))
        return (
            f"{what} {self.seconds_ago:.0f} s ago: {self.reason} "
            f"(TTFT {ttft}, ITL {itl}; {self.prefill} prefill, {self.decode} decode; busy {busy})"
        )


class PlannerStats(msgspec.Struct, frozen=True, kw_only=True):
    """The planner (a plan with ``[planner] enabled = true``): its targets and decisions."""

    ttft_s: float  # the targets
    itl_s: float
    percentile: float
    interval_s: float
    decisions: dict[str, int] = {}  # since start, by action ("move", "hold")
    last: PlannerDecision | None = None
    last_move: PlannerDecision | None = None  # the last decision that moved an instance

    def describe(self) -> list[str]:
        """``kvasir stats``'s lines for the planner."""
        moves = self.decisions.get("move", 0)
        lines = [
            f"planner: targets TTFT {self.ttft_s:g} s, ITL {self.itl_s:g} s at p{self.percentile:g}, "
            f"every {self.interval_s:g} s; {sum(self.decisions.values())} decisions, {moves} moves"
        ]
        last = self.last
        if last is not None:
            lines.append(f"  last decision: {last.describe()}")
        if self.last_move is not None and (last is None or last.action != "move"):
            lines.append(f"  last move: {self.last_move.describe()}")
        return lines
