"""The bridge's way into the instances: one socket to each head (requests go to a
colocated or prefill instance's; with [planner] any instance may become one), the
conductor that picks one per request (kvasir/bridge/conductor.py), which instance each
stage belongs to and which pool each instance serves now."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Literal

import zmq

from kvasir.bridge.conductor import Candidate, Choice, Conductor
from kvasir.bridge.pool import PoolView
from kvasir.config.cluster import ring_hosts
from kvasir.config.fleet import Ring
from kvasir.config.plan import Plan
from kvasir.config.sections import Pool
from kvasir.errors import RequestError
from kvasir.transport.channels import BatchedSocket
from kvasir.transport.fabric import Sockets
from kvasir.wire.fleet import InstanceStats
from kvasir.wire.stats import StageStats


class Heads:
    def __init__(self, plan: Plan, sockets: Sockets, kv_bytes_per_token: int = 0) -> None:
        """``kv_bytes_per_token``: the model's (sizes the KV pool's index)."""
        rings = plan.rings()
        self.rings = rings
        self.sockets = sockets
        self.disaggregated = plan.disaggregated
        self.instance_of = {index: ring.name for ring in rings for index in range(ring.first, ring.last + 1)}
        self.pool_of: dict[str, Pool] = {ring.name: ring.pool for ring in rings}  # the pool each serves now
        self.fixed = {ring.name: ring.fixed for ring in rings}  # why each stays in its pool ("": it may move)
        self.conductor = Conductor(  # nothing is routed to an instance before the launcher says "serve"
            plan.route.policy,
            (self._candidate(ring) for ring in rings if ring.pool != "decode"),
            (self._candidate(ring) for ring in rings if ring.pool == "decode"),
        )
        self.head_of = {ring.name: ring.first for ring in rings}
        self.pool = PoolView(plan, kv_bytes_per_token) if plan.kv_pool is not None else None  # the KV pool's index
        self.pids: dict[str, frozenset[int]] = {}  # the serving instances' stage processes
        self.restarts: dict[str, int] = {}  # each instance's restarts so far
        self.failures: dict[str, str] = {}  # each instance's last failure
        self.parked: set[str] = set()  # instances waiting for their standby or drained host to join
        self.hosts = {ring.name: sorted(ring_hosts(plan.cluster, ring)) for ring in rings}  # where its workers run
        self.leader = plan.cluster.leader if plan.cluster is not None else None
        self._io: dict[str, tuple[zmq.Socket, BatchedSocket]] = {}
        for ring in rings:
            self._io[ring.name] = self._connect(ring)

    @staticmethod
    def _candidate(ring: Ring[Plan]) -> Candidate:
        return Candidate(ring.name, ring.plan.kv.block_size, ring.plan.kv.num_blocks, "down")

    def _connect(self, ring: Ring[Plan]) -> tuple[zmq.Socket, BatchedSocket]:
        # unbounded: accepted requests are bounded by bridge.max_waiting, and a send that
        # waited for a dead head would stall every client
        head = self.sockets.unbound(zmq.PUSH)
        head.setsockopt(zmq.SNDHWM, 0)
        self.sockets.attach(head, self.sockets.ends.stage_in(ring.first))
        return head, BatchedSocket(head)

    def pick(self, prompt: Sequence[int], root: bytes, session: str | None) -> tuple[Choice, str | None]:
        """The instance for a request, and in a disaggregated plan the decode instance it
        goes on to (RequestError "restarting" when none serves). A session is known by
        its id within the request's cache namespace, so two tenants' ids never meet."""
        key = root + b"\x00" + session.encode() if session is not None else None
        choice = self.conductor.pick(prompt, root, time.monotonic(), key)
        try:
            # a mixed instance (with [planner]) runs both phases itself: no decode instance
            decode = self.conductor.pick_decode() if self.pool_of[choice.name] == "prefill" else None
        except RequestError:
            self.conductor.ended(choice.name, choice.backlog)
            raise
        if self.pool is not None:
            pooled = self.pool.pooled(choice.name, prompt, root)
            reason = f"{choice.reason}; kv pool: {pooled.why}" if pooled.why else choice.reason
            choice = dataclasses.replace(choice, pooled=pooled.blocks, peers=pooled.peers, reason=reason)
        return choice, decode

    def first_token(self, record) -> None:
        """A request's first token came (``record``: its kvasir/bridge/ledger.py Pending):
        its prompt leaves its instance's backlog; the KV pool learns how fast its instance
        computed the prompt tokens it did not find cached."""
        self.conductor.first_token(record.instance, record.backlog)
        if self.pool is not None and not any(record.pooled_tokens) and record.enqueued_ns:
            running_ns = record.first_ns - record.enqueued_ns - record.queued_ns
            self.pool.prefilled(record.instance, record.prompt_tokens - record.cached_tokens, running_ns / 1e9)

    def send_now(self, instance: str, body: bytes) -> None:
        self._io[instance][1].send_now([body])

    async def send(self, instance: str, body: bytes) -> None:
        await self._io[instance][1].send(body)

    def names(self, instance: str) -> list[str]:
        """The instances a command names ("": every one)."""
        return [name for name in self.pool_of if instance in ("", name)]

    def serve(self, instance: str, pids: tuple[int, ...], restarts: int, pool: Pool | None = None) -> None:
        """An instance is ready: its processes' reports count, and requests go to it
        (``pool``: the pool it serves now, where it moved)."""
        if pool is not None and pool != self.pool_of[instance]:
            self.pool_of[instance] = pool
            self.conductor.assign(instance, decode=pool == "decode")
        self.pids[instance] = frozenset(pids)
        self.restarts[instance] = restarts
        self.parked.discard(instance)
        self.conductor.up(instance)
        if self.pool is not None:
            self.pool.serve(pids)

    def down(self, instance: str, reason: str) -> None:
        """An instance failed: drop what was queued for its dead head, ignore its old
        processes' reports, and route nothing to it until it serves again."""
        self.failures[instance] = reason
        self.park(instance, parked=False)

    def park(self, instance: str, parked: bool = True) -> None:
        """An instance stops serving (parked: its host is away, not a failure)."""
        self.pids.pop(instance, None)
        if parked:
            self.parked.add(instance)
            if self.pool is not None:  # a host all of whose instances are parked serves none of its KV pool tiers
                on = self.hosts.items()
                idle = [h for h in self.hosts[instance] if all(n in self.parked for n, at in on if h in at)]
                self.pool.forget_hosts(idle)
        self.conductor.down(instance)
        ring = next(ring for ring in self.rings if ring.name == instance)
        head, _ = self._io[instance]
        head.close(linger=0)
        self._io[instance] = self._connect(ring)

    def cancel_to(self, instance: str, decode: str | None) -> str:
        """Where a request's cancel goes: its admitting instance's head, which passes it on
        after a hand-off; or, once that instance has moved out of the prefill pool (the
        request was handed on before it moved), its decode instance's head."""
        if decode is not None and self.pool_of.get(instance) != "prefill":
            return decode
        return instance

    def current(self, index: int, pid: int) -> bool:
        """A report from the serving process of stage ``index`` (not from a replaced one)."""
        return pid in self.pids.get(self.instance_of.get(index, ""), frozenset())

    @property
    def serving(self) -> bool:
        return bool(self.pids)

    def total_restarts(self) -> int:
        """Restarts after failures: each instance's, summed; a disaggregated plan's
        instances restart together, once per failure."""
        counts = self.restarts.values()
        return max(counts, default=0) if self.disaggregated else sum(counts)

    def candidate(self, name: str) -> Candidate | None:
        """The conductor's view of an instance, on whichever side it serves now."""
        return self.conductor.candidates.get(name) or self.conductor.decoders.get(name)

    def _state(self, name: str) -> Literal["serving", "parked", "restarting"]:
        return "serving" if name in self.pids else "parked" if name in self.parked else "restarting"

    def report(self, heads: dict[int, StageStats]) -> list[InstanceStats]:
        """Each instance for ``kvasir stats``, with its head's latest report (by index)."""
        out = []
        for ring in self.rings:
            candidate = self.candidate(ring.name)
            head = heads.get(ring.first)
            out.append(
                InstanceStats(
                    name=ring.name,
                    pool=self.pool_of[ring.name],
                    state=self._state(ring.name),
                    hosts=self.hosts[ring.name],
                    movable=ring.movable,
                    stages=list(range(ring.first, ring.last + 1)),
                    restarts=self.restarts.get(ring.name, 0),
                    last_failure=self.failures.get(ring.name),
                    requests=candidate.running if candidate else 0,
                    routed=candidate.routed if candidate else 0,
                    backlog=candidate.backlog if candidate else 0,
                    prefix=head.prefix if head is not None else None,
                )
            )
        return out
