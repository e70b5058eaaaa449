"""Instances moving between pools (a plan with [planner], docs/planner.md): the bridge's side.

A move has three phases:

- ``finishing``: nothing new is routed to the instance (the conductor's "leaving"); the
  requests the bridge sent there run on: a prefill instance's until their first token
  (then they are the decode pool's), a decode instance's to their end.
- ``retiring``: none of them is left; its head is asked (``Retire``) to say when it holds
  no request (a prefill head keeps a handed-off request's KV until the decode head
  took it).
- ``regrouping``: the head said ``Retired``; the launcher tells the instance's processes
  to serve the new pool (``Regroup``; they keep their weights and KV cache,
  kvasir/stage/roles.py) and, once each stage is ready again, tells the bridge to serve
  it there ("serve" with its pool), which ends the move.

No request is ended by a move. An instance that fails meanwhile restarts as any failed
instance does (in the pool it was moving to, if it had got that far), and its move is
forgotten.

Draining a host (``kvasir hosts drain``) moves each of its instances out the same way,
to "parked": after ``retiring``, ``parking``: the launcher stops its processes and
says "parked" (kvasir/daemon/supervisor.py); it serves again once the host's
``kvasird join`` is started anew.

With ``[planner] enabled = true`` the planner (kvasir/bridge/planner.py) decides moves
too: ``follow`` asks it once per interval and starts the move it decides.
Bookkeeping and checks only: the bridge sends what these answers say.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import msgspec

from kvasir.bridge.heads import Heads
from kvasir.bridge.ledger import Ledger, Pending
from kvasir.bridge.planner import Member, Planner
from kvasir.config.roles import PlannerSpec
from kvasir.config.sections import Pool
from kvasir.errors import RequestError
from kvasir.logs import Logger
from kvasir.wire.client import DrainHost, DrainStarted, ErrorEvent, Move, MoveStarted
from kvasir.wire.fleet import InstanceStats, MovablePool, MovePhase, MoveState, MoveTarget, MoveTo, target_pool
from kvasir.wire.stats import StageStats


@dataclass
class Moving:
    to: MoveTo
    since: float  # when it was decided (the bridge's monotonic clock)
    phase: MovePhase = "finishing"
    drain: str = ""  # to "parked": the host being drained


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

    def asked(
        self, asking: Move | DrainHost, local: bool, draining: bool, now: float
    ) -> MoveStarted | DrainStarted | ErrorEvent:
        """A client asks for a move or a host's drain (``local``: on the daemon's own socket): the answer."""
        try:
            if not local:
                raise RequestError(
                    "invalid_request", "instances are moved and hosts drained from the daemon's host only"
                )
            if draining:
                raise RequestError("shutting_down", "the daemon is shutting down")
            if isinstance(asking, DrainHost):
                leaving = self.drain(asking.host, now)
            else:
                self.start(asking.instance, asking.to, now)
                leaving = [asking.instance]
        except RequestError as exc:
            return ErrorEvent(code=exc.code, message=exc.message, key=asking.key)
        running = sum(c.running for c in map(self.heads.candidate, leaving) if c is not None)
        if isinstance(asking, DrainHost):
            self.log.info("draining a host", host=asking.host, instances=leaving, requests=running)
            return DrainStarted(key=asking.key, host=asking.host, instances=leaving, requests=running)
        self.log.info("moving", instance=asking.instance, to=asking.to, requests=running)
        return MoveStarted(key=asking.key, instance=asking.instance, to=asking.to, requests=running)

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
        self._serving(name)
        self._keeps(pool, [name], f"moving {name}")

    def _serving(self, name: str) -> None:
        if name in self.heads.parked:
            raise RequestError("invalid_request", f"instance {name} is parked: it serves once its host joins")
        if name not in self.heads.pids:
            raise RequestError("restarting", f"instance {name} is restarting: move it once it serves")

    def _keeps(self, pool: Pool, leaving: list[str], what: str) -> None:
        """RequestError when ``leaving`` would leave ``pool`` fewer serving instances than
        its minimum: the planner's min_prefill / min_decode (1 without it), a colocated
        fleet's 1; the mixed role has none."""
        heads = self.heads
        if not pool and heads.disaggregated:
            return
        least = getattr(self.planner, f"min_{pool}", 1) if pool else 1
        staying = [
            n
            for n, p in heads.pool_of.items()
            if p == pool and n in heads.pids and n not in self.moving and n not in leaving
        ]
        if len(staying) < least:
            rule = f"planner.min_{pool} = {least}" if pool and self.planner is not None else "one at least"
            raise RequestError(
                "invalid_request",
                f"{what} would leave the {pool or 'colocated'} pool {len(staying)} serving instances ({rule})",
            )

    def drain(self, host: str, now: float) -> list[str]:
        """Begin moving every serving instance of ``host`` out to "parked"; their names
        (RequestError saying why it cannot)."""
        if host == self.heads.leader:
            raise RequestError("invalid_request", f"host {host} is the leader: stop the daemon instead")
        on = [name for name, hosts in self.heads.hosts.items() if host in hosts]
        if not on:
            known = sorted({h for hosts in self.heads.hosts.values() for h in hosts} - {self.heads.leader})
            raise RequestError(
                "invalid_request",
                f"no instance runs on host {host!r} (hosts with instances: {', '.join(known) or 'none'})",
            )
        leaving = [name for name in on if name not in self.heads.parked]
        for name in leaving:
            if name in self.moving:
                raise RequestError("invalid_request", f"instance {name} is moving to {self.moving[name].to}")
            self._serving(name)
        for pool in sorted({self.heads.pool_of[name] for name in leaving}):
            self._keeps(pool, leaving, f"draining host {host}")
        for name in leaving:
            self.heads.conductor.leave(name)
            self.moving[name] = Moving("parked", now, drain=host)
        return leaving

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

    def retired(self, index: int, pid: int) -> tuple[str, Pool, str] | None:
        """A head said it holds nothing: the instance to restart, its new pool and the
        host being drained ("": none; then it parks) (None: no retiring move of the
        current head's)."""
        name = self.heads.instance_of.get(index)
        move = self.moving.get(name or "")
        if name is None or move is None or move.phase != "retiring" or not self.heads.current(index, pid):
            return None
        move.phase = "parking" if move.to == "parked" else "regrouping"
        return name, target_pool(move.to) if move.to != "parked" else self.heads.pool_of[name], move.drain

    def parked(self, name: str, now: float) -> None:
        """The launcher parked an instance: a drain's move of it is over."""
        move = self.moving.pop(name, None)
        if move is not None and self.auto is not None:
            self.auto.moved(now)

    def served(self, name: str, now: float) -> float | None:
        """An instance serves again: the seconds its move took, if it was one."""
        move = self.moving.get(name)
        if move is None or move.phase != "regrouping":
            return None
        del self.moving[name]
        if self.auto is not None:
            self.auto.moved(now)
        self.made[name] = self.made.get(name, 0) + 1
        self.last_s[name] = now - move.since
        return self.last_s[name]

    async def follow(self, ledger: Ledger, stages: Mapping[int, StageStats]) -> None:
        """The planner's loop (a plan with it enabled): one decision per interval, on the
        requests in ``ledger`` and the stages' latest reports (``stages``, by index)."""
        if self.auto is None:
            raise RuntimeError("the planner's loop started for a plan without [planner] enabled")
        while True:
            await asyncio.sleep(self.auto.spec.interval_s)
            self.plan(ledger, stages, time.monotonic())

    def plan(self, ledger: Ledger, stages: Mapping[int, StageStats], now: float) -> None:
        """The planner decides on the interval's samples; a move it decides starts now."""
        if self.auto is None:
            return
        waiting = [(now * 1e9 - record.submitted_ns) / 1e9 for _, record in ledger.items() if not record.first_ns]
        members = self.members(self.auto.busy.shares(stages))
        decision = self.auto.decide(waiting, members, bool(self.moving), now)
        self.log.info("planner", **{k: getattr(decision, k) for k in decision.__struct_fields__ if k != "seconds_ago"})
        if decision.action != "move" or decision.instance is None or decision.to is None:
            return
        try:
            self.start(decision.instance, decision.to, now)
        except RequestError as exc:
            self.log.warning("the planner's move was refused", instance=decision.instance, reason=exc.message)

    def members(self, shares: Mapping[int, float]) -> dict[MovablePool, list[Member]]:
        """Each pool's serving instances that are not moving, with their load: requests, and
        its busiest stage's busy share (``shares``, by stage index)."""
        heads = self.heads
        busiest: dict[str, float] = {}
        for index, share in shares.items():
            name = heads.instance_of.get(index)
            if name is not None:
                busiest[name] = max(share, busiest.get(name, 0.0))
        out: dict[MovablePool, list[Member]] = {"prefill": [], "decode": []}
        for name, pool in heads.pool_of.items():
            if name in heads.pids and name not in self.moving and pool in ("prefill", "decode"):
                candidate = heads.candidate(name)
                running = candidate.running if candidate else 0
                out[pool].append(Member(name, running, not heads.fixed[name], busiest.get(name)))
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
