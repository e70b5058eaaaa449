"""Instances moving between pools (a plan with [planner], docs/planner.md): the bridge's side.

A move has three phases:

- ``finishing``: nothing new is routed to the instance (the conductor's "leaving"); the
  requests the bridge sent there run on: a prefill instance's until their first token
  (then they are the decode pool's), a decode instance's to their end.
- ``retiring``: none of them is left; its head is asked (``Retire``) to say when it holds
  no request (a prefill head keeps a handed-off request's KV until the decode head
  took it).
- ``restarting``: the head said ``Retired``; the launcher restarts the instance's
  processes in the new pool (``Regroup``) and, once they are ready, tells the bridge to
  serve it there ("serve" with its pool), which ends the move.

No request is ended by a move. An instance that fails meanwhile restarts as any failed
instance does (in the pool it was last started for), and its move is forgotten.

With ``[planner] enabled = true`` the planner (kvasir/bridge/planner.py) decides moves
too: ``follow`` asks it once per interval and starts the move it decides.
Bookkeeping and checks only: the bridge sends what these answers say.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

import msgspec

from kvasir.bridge.heads import Heads
from kvasir.bridge.ledger import Ledger, Pending
from kvasir.bridge.planner import Member, Planner
from kvasir.config.roles import PlannerSpec
from kvasir.config.sections import Pool
from kvasir.errors import RequestError
from kvasir.logs import Logger
from kvasir.wire.client import ErrorEvent, Move, MoveStarted
from kvasir.wire.fleet import InstanceStats, MovablePool, MoveState, MoveTarget, target_pool

MovePhase = Literal["finishing", "retiring", "restarting"]


@dataclass
class Moving:
    to: MoveTarget
    since: float  # when it was decided (the bridge's monotonic clock)
    phase: MovePhase = "finishing"


@dataclass
class Moves:
    heads: Heads
    log: Logger
    planner: PlannerSpec | None  # its min_prefill, min_decode: serving instances a pool keeps at least
    moving: dict[str, Moving] = field(default_factory=dict)
    made: dict[str, int] = field(default_factory=dict)  # moves each instance finished
    last_s: dict[str, float] = field(default_factory=dict)  # each one's last: decision to serving
    auto: Planner | None = None  # the planner, where the plan enables it

    def __post_init__(self) -> None:
        if self.planner is not None and self.planner.enabled:
            self.auto = Planner(self.planner)

    def asked(self, move: Move, local: bool, draining: bool, now: float) -> MoveStarted | ErrorEvent:
        """A client asks for a move (``local``: on the daemon's own socket): the answer."""
        try:
            if not local:
                raise RequestError("invalid_request", "instances are moved from the daemon's host only")
            if draining:
                raise RequestError("shutting_down", "the daemon is shutting down")
            self.start(move.instance, move.to, now)
        except RequestError as exc:
            return ErrorEvent(code=exc.code, message=exc.message, key=move.key)
        candidate = self.heads.candidate(move.instance)
        running = candidate.running if candidate is not None else 0
        self.log.info("moving", instance=move.instance, to=move.to, requests=running)
        return MoveStarted(key=move.key, instance=move.instance, to=move.to, requests=running)

    def start(self, name: str, to: MoveTarget, now: float) -> None:
        """Begin moving instance ``name`` to ``to``; RequestError saying why it cannot."""
        self._check(name, to)
        self.heads.conductor.leave(name)
        self.moving[name] = Moving(to, now)

    def _check(self, name: str, to: MoveTarget) -> None:
        heads = self.heads
        pool = heads.pool_of.get(name)
        if pool is None:
            raise RequestError("invalid_request", f"no instance is named {name!r} (`kvasir instances` lists them)")
        if heads.fixed[name]:
            raise RequestError("invalid_request", f"instance {name} cannot move: {heads.fixed[name]}")
        if name in self.moving:
            raise RequestError("invalid_request", f"instance {name} is already moving to {self.moving[name].to}")
        if pool == target_pool(to):
            raise RequestError("invalid_request", f"instance {name} already serves the {to} pool")
        if name not in heads.pids:
            raise RequestError("restarting", f"instance {name} is restarting: move it once it serves")
        if not pool:
            return  # the mixed role has no minimum
        staying = [n for n, p in heads.pool_of.items() if p == pool and n in heads.pids and n not in self.moving]
        least = getattr(self.planner, f"min_{pool}", 1)
        if len(staying) - 1 < least:
            raise RequestError(
                "invalid_request",
                f"moving {name} would leave the {pool} pool {len(staying) - 1} serving instances "
                f"(planner.min_{pool} = {least})",
            )

    def due(self, ledger: Ledger) -> list[str]:
        """Finishing moves none of whose requests is left: their heads are to be asked to
        retire now (each once)."""
        finishing = [name for name, move in self.moving.items() if move.phase == "finishing"]
        if not finishing:
            return []
        busy = set(self.busy(record for _, record in ledger.items()))
        ready = [name for name in finishing if name not in busy]
        for name in ready:
            self.moving[name].phase = "retiring"
        return ready

    @staticmethod
    def busy(requests: Iterable[Pending]) -> Iterable[str]:
        """The instances requests still need: a prompt's until its first token, a decode
        instance's to the end, a mixed instance's (no decode instance) to the end."""
        for record in requests:
            if not record.first_ns or record.decode is None:
                yield record.instance
            if record.decode is not None:
                yield record.decode

    def retired(self, index: int, pid: int) -> tuple[str, Pool] | None:
        """A head said it holds nothing: the instance to restart, and its new pool (None:
        no retiring move of the current head's)."""
        name = self.heads.instance_of.get(index)
        move = self.moving.get(name or "")
        if name is None or move is None or move.phase != "retiring" or not self.heads.current(index, pid):
            return None
        move.phase = "restarting"
        return name, target_pool(move.to)

    def served(self, name: str, now: float) -> float | None:
        """An instance serves again: the seconds its move took, if it was one."""
        move = self.moving.get(name)
        if move is None or move.phase != "restarting":
            return None
        del self.moving[name]
        if self.auto is not None:
            self.auto.moved(now)
        self.made[name] = self.made.get(name, 0) + 1
        self.last_s[name] = now - move.since
        return self.last_s[name]

    async def follow(self, ledger: Ledger) -> None:
        """The planner's loop (a plan with it enabled): one decision per interval."""
        if self.auto is None:
            raise RuntimeError("the planner's loop started for a plan without [planner] enabled")
        while True:
            await asyncio.sleep(self.auto.spec.interval_s)
            self.plan(ledger, time.monotonic())

    def plan(self, ledger: Ledger, now: float) -> None:
        """The planner decides on the interval's samples; a move it decides starts now."""
        if self.auto is None:
            return
        waiting = [(now * 1e9 - record.submitted_ns) / 1e9 for _, record in ledger.items() if not record.first_ns]
        decision = self.auto.decide(waiting, self.members(), bool(self.moving), now)
        self.log.info("planner", **{k: getattr(decision, k) for k in decision.__struct_fields__ if k != "seconds_ago"})
        if decision.action != "move" or decision.instance is None or decision.to is None:
            return
        try:
            self.start(decision.instance, decision.to, now)
        except RequestError as exc:
            self.log.warning("the planner's move was refused", instance=decision.instance, reason=exc.message)

    def members(self) -> dict[MovablePool, list[Member]]:
        """Each pool's serving instances that are not moving, with their load."""
        heads = self.heads
        out: dict[MovablePool, list[Member]] = {"prefill": [], "decode": []}
        for name, pool in heads.pool_of.items():
            if name in heads.pids and name not in self.moving and pool in ("prefill", "decode"):
                candidate = heads.candidate(name)
                out[pool].append(Member(name, candidate.running if candidate else 0, not heads.fixed[name]))
        return out

    def dropped(self, names: Iterable[str]) -> None:
        """Instances went down: their moves are over (they restart as failed instances do)."""
        for name in names:
            self.moving.pop(name, None)

    def annotate(self, instances: list[InstanceStats], now: float) -> list[InstanceStats]:
        """``kvasir stats``'s instances with their moves."""
        out = []
        for stats in instances:
            move = self.moving.get(stats.name)
            state = (
                MoveState(to=move.to, phase=move.phase, seconds=now - move.since, requests=stats.requests)
                if move is not None
                else None
            )
            out.append(
                msgspec.structs.replace(
                    stats,
                    state="moving" if move is not None else stats.state,
                    move=state,
                    moves=self.made.get(stats.name, 0),
                    last_move_s=self.last_s.get(stats.name),
                )
            )
        return out
