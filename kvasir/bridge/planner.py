"""The planner (a plan's ``[planner] enabled = true``, docs/planner.md): pools that follow
the load.

Every ``interval_s`` it reads that interval's samples:

- **time to first token**, the prefill pool's figure: each request whose first token
  came in the interval, and each prompt still waiting, at its age so far (a pool so far
  behind that no first token comes shows all the same);
- **inter-token latency**, the decode pool's: each gap between a request's tokens.

A pool's *load* is its figure at the ``percentile`` over its target (1: on target); its
*busy share* is the mean over its instances of their busiest stage's share of the
interval spent running batches (each stage reports its busy and wall seconds). A pool
that misses (load above 1) gets an instance from the other pool when that one has
slack: its busy share scaled to one instance fewer (``n / (n - 1)``) stays under
``headroom``, and it keeps more instances than its minimum. While both pools meet
their targets, the busier one gets an instance when it is busy ``WORKING`` (half) of
the time or more and the other's, one instance fewer, stays under ``headroom`` and under the
busier one's with one more (``m / (m + 1)``): the move evens the pools out, and the
same readings cannot ask for it back. Against flapping: the same pool must be short
``patience`` intervals in a row, no move is decided while one is under way, and after
a move ends there is none for ``cooldown_s`` (and the samples start again). The
instance that moves is the giving pool's movable one with the fewest requests on it,
the quickest to empty.

Policy only: no sockets, no clock of its own. The bridge feeds it samples and carries
out its moves through kvasir/bridge/moves.py.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import msgspec

from kvasir.config.roles import PlannerSpec
from kvasir.wire.fleet import MovablePool, PlannerAction, PlannerDecision, PlannerStats
from kvasir.wire.stats import StageStats

SAMPLES_KEPT = 1 << 16  # of each kind per interval: the most recent
WORKING = 0.5  # while both pools meet their targets, one busy this share of the time or more asks for an instance


class Member(NamedTuple):
    """A serving instance of a pool, not moving."""

    name: str
    requests: int  # the bridge's requests on it now
    movable: bool
    busy: float | None = None  # its busiest stage's busy share of the interval (None: not measured)


@dataclass(frozen=True)
class PoolReading:
    """One pool in one interval."""

    pool: MovablePool
    figure_s: float | None  # its latency at the percentile (None: no sample)
    target_s: float
    instances: int  # serving, none moving
    busy: float | None  # its instances' mean busy share (None: none measured)

    @property
    def load(self) -> float:
        return 0.0 if self.figure_s is None else self.figure_s / self.target_s

    @property
    def one_fewer(self) -> float:
        """Its busy share with one instance fewer (the work spread over the rest)."""
        if self.busy is None or self.instances < 2:
            return float("inf")
        return self.busy * self.instances / (self.instances - 1)

    @property
    def one_more(self) -> float:
        """Its busy share with one instance more."""
        return (self.busy or 0.0) * self.instances / (self.instances + 1)


def percentile(values: Iterable[float], share: float) -> float | None:
    """The ``share`` (0-100) percentile by nearest rank; None for no values."""
    ordered = sorted(values)
    if not ordered:
        return None
    rank = max(1, -(-len(ordered) * share // 100))  # ceil
    return ordered[int(rank) - 1]


def _busy(members: Sequence[Member]) -> tuple[int, float | None]:
    """A pool's serving instances and their mean busy share (of those measured)."""
    shares = [m.busy for m in members if m.busy is not None]
    return len(members), sum(shares) / len(shares) if shares else None


class Samples:
    """One interval's samples, the most recent ``SAMPLES_KEPT`` of each kind."""

    def __init__(self) -> None:
        self.first_token_s: deque[float] = deque(maxlen=SAMPLES_KEPT)
        self.gap_s: deque[float] = deque(maxlen=SAMPLES_KEPT)

    def first_token(self, seconds: float) -> None:
        self.first_token_s.append(seconds)

    def gap(self, seconds: float) -> None:
        self.gap_s.append(seconds)

    def clear(self) -> None:
        self.first_token_s.clear()
        self.gap_s.clear()


class StageBusy:
    """Each stage's busy share between two readings: the busy seconds over the wall seconds
    its reports added in between (a stage new since, or unreported: not measured)."""

    def __init__(self) -> None:
        self.seen: dict[int, tuple[int, float, float]] = {}  # by stage index: pid, busy_s, wall_s

    def shares(self, reports: Mapping[int, StageStats]) -> dict[int, float]:
        """By stage index, each measured stage's share since the previous call."""
        out = {}
        for index, report in reports.items():
            before = self.seen.get(index)
            self.seen[index] = (report.pid, report.busy_s, report.wall_s)
            if before is not None and before[0] == report.pid and report.wall_s > before[2]:
                share = (report.busy_s - before[1]) / (report.wall_s - before[2])
                out[index] = min(1.0, max(0.0, share))
        return out


@dataclass
class Planner:
    spec: PlannerSpec
    samples: Samples = field(default_factory=Samples)
    busy: StageBusy = field(default_factory=StageBusy)
    streak: tuple[MovablePool | None, int] = (None, 0)  # the pool missing, intervals in a row
    quiet_until: float = 0.0  # no decision before this (after a move)
    decisions: dict[str, int] = field(default_factory=dict)
    last: tuple[float, PlannerDecision] | None = None  # when, what
    last_move: tuple[float, PlannerDecision] | None = None

    def decide(
        self, waiting_s: Sequence[float], members: Mapping[MovablePool, Sequence[Member]], moving: bool, now: float
    ) -> PlannerDecision:
        """The interval's decision: ``waiting_s``, the ages of prompts without a first token;
        ``members``, each pool's serving instances not moving; ``moving``: a move is under way."""
        prefill, decode = self._readings(waiting_s, members)
        self.samples.clear()
        if moving:
            self.streak = (None, 0)
            decision = self._decision("hold", "a move is under way", prefill, decode)
        elif now < self.quiet_until:
            left = self.quiet_until - now
            decision = self._decision("hold", f"a move ended: cooling down ({left:.0f} s left)", prefill, decode)
        else:
            decision = self._weigh(prefill, decode, members)
        self.decisions[decision.action] = self.decisions.get(decision.action, 0) + 1
        self.last = (now, decision)
        if decision.action == "move":
            self.last_move = (now, decision)
        return decision

    def moved(self, now: float) -> None:
        """A move ended (the planner's or by hand): cool down, and sample afresh."""
        self.quiet_until = now + self.spec.cooldown_s
        self.streak = (None, 0)
        self.samples.clear()

    def _readings(
        self, waiting_s: Sequence[float], members: Mapping[MovablePool, Sequence[Member]]
    ) -> tuple[PoolReading, PoolReading]:
        spec, samples = self.spec, self.samples
        ttft = percentile([*samples.first_token_s, *waiting_s], spec.percentile)
        itl = percentile(samples.gap_s, spec.percentile)
        return (
            PoolReading("prefill", ttft, spec.ttft_s, *_busy(members.get("prefill", ()))),
            PoolReading("decode", itl, spec.itl_s, *_busy(members.get("decode", ()))),
        )

    def _weigh(
        self, prefill: PoolReading, decode: PoolReading, members: Mapping[MovablePool, Sequence[Member]]
    ) -> PlannerDecision:
        """Which pool needs an instance the other can spare, and for how long it has."""
        short, why = self._short(prefill, decode)
        pool, count = self.streak
        count = count + 1 if short is not None and short == pool else int(short is not None)
        self.streak = (short, count)
        if short is None or count < self.spec.patience:
            if short is not None:
                why += f" ({count} of {self.spec.patience} intervals in a row)"
            return self._decision("hold", why, prefill, decode)
        giver: MovablePool = "decode" if short == "prefill" else "prefill"
        movable = [m for m in members.get(giver, ()) if m.movable]
        if not movable:
            return self._decision("hold", f"{why}, but no {giver} instance is movable", prefill, decode)
        chosen = min(movable, key=lambda m: (m.requests, m.name))
        self.streak = (None, 0)
        return self._decision("move", why, prefill, decode, chosen.name, short)

    def _short(self, prefill: PoolReading, decode: PoolReading) -> tuple[MovablePool | None, str]:
        """The pool that misses while the other has slack, or the busier one while both
        meet (None: neither), and why."""
        if prefill.load > 1 and decode.load > 1:
            return None, "both pools miss their targets: neither has an instance to spare"
        if prefill.load <= 1 and decode.load <= 1:
            return self._busier(prefill, decode)
        short, giver = (prefill, decode) if prefill.load > 1 else (decode, prefill)
        why = f"the {short.pool} pool misses its target ({short.load:.2f} of it)"
        if (held := self._spares(giver, why)) is not None:
            return None, held
        return short.pool, f"{why}; the {giver.pool} pool has slack ({giver.one_fewer:.2f} busy with one fewer)"

    def _busier(self, prefill: PoolReading, decode: PoolReading) -> tuple[MovablePool | None, str]:
        """Both meet their targets: the busier pool, where the other can spare an instance and
        the move evens them out."""
        why = "both pools meet their targets"
        if prefill.busy is None or decode.busy is None:
            return None, why
        busier, giver = (prefill, decode) if prefill.busy >= decode.busy else (decode, prefill)
        if busier.busy is None or busier.busy < WORKING:
            return None, why
        why += f", but the {busier.pool} pool is busy ({busier.busy:.2f} of the time)"
        if (held := self._spares(giver, why)) is not None:
            return None, held
        if giver.one_fewer >= busier.one_more:
            return None, (
                f"{why}; the {giver.pool} pool one instance fewer ({giver.one_fewer:.2f}) would be as busy "
                f"as the {busier.pool} pool one more ({busier.one_more:.2f})"
            )
        return busier.pool, f"{why}; the {giver.pool} pool has slack ({giver.one_fewer:.2f} busy with one fewer)"

    def _spares(self, giver: PoolReading, why: str) -> str | None:
        """Why ``giver`` cannot spare an instance (None: it can)."""
        least = getattr(self.spec, f"min_{giver.pool}")
        if giver.instances <= least:
            return f"{why}, but the {giver.pool} pool is at planner.min_{giver.pool} = {least}"
        if giver.busy is None:
            return f"{why}, but the {giver.pool} pool's stages have not reported how busy they are"
        if giver.one_fewer > self.spec.headroom:
            return (
                f"{why}, but the {giver.pool} pool has no slack: one instance fewer its stages would be "
                f"busy {giver.one_fewer:.2f} of the time (planner.headroom = {self.spec.headroom:g})"
            )
        return None

    def _decision(
        self,
        action: PlannerAction,
        reason: str,
        prefill: PoolReading,
        decode: PoolReading,
        instance: str | None = None,
        to: MovablePool | None = None,
    ) -> PlannerDecision:
        return PlannerDecision(
            action=action,
            reason=reason,
            ttft_s=prefill.figure_s,
            itl_s=decode.figure_s,
            prefill=prefill.instances,
            decode=decode.instances,
            prefill_busy=prefill.busy,
            decode_busy=decode.busy,
            instance=instance,
            to=to,
        )

    def stats(self, now: float) -> PlannerStats:
        """For ``kvasir stats``: the targets, the counts, the last decisions with their ages."""
        spec = self.spec

        def aged(entry: tuple[float, PlannerDecision] | None) -> PlannerDecision | None:
            return None if entry is None else msgspec.structs.replace(entry[1], seconds_ago=now - entry[0])

        return PlannerStats(
            ttft_s=spec.ttft_s,
            itl_s=spec.itl_s,
            percentile=spec.percentile,
            interval_s=spec.interval_s,
            decisions=dict(self.decisions),
            last=aged(self.last),
            last_move=aged(self.last_move),
        )
