"""The stage agent: one process, one slice, a plain synchronous loop around torch.

Where a stage's work comes from (the head's scheduler, or the upstream stage's
descriptors) and where it goes (the downstream stage's slots, or the tail's sampler)
is chosen once at construction; the loop itself never branches on topology.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import zmq

from kvasir.model.pinning import Threads
from kvasir.stage.engine import StageEngine
from kvasir.stage.pooling import NoPool
from kvasir.stage.ports import PoolPart, PoolParts, RegroupError
from kvasir.transport.channels import PullChannel, PushChannel
from kvasir.wire.batch import BatchDescriptor
from kvasir.wire.bridge import PrefixEvents
from kvasir.wire.control import Command, Heartbeat, Ready
from kvasir.wire.shares import imbalance
from kvasir.wire.stats import BatchSpan, ExpertLoad, GpuMemory, KvUse, StageStats

POLL_MS = 50
SPANS_PER_REPORT = 2048  # batch spans a stage keeps between two stats reports


@dataclass
class Clock:
    """Busy, starved and blocked seconds, and what passed through (kvasir/wire/shares.py)."""

    started: float
    busy_s: float = 0.0
    starved_s: float = 0.0
    blocked_s: float = 0.0
    batches: int = 0
    rows: int = 0
    tokens: int = 0
    spans: deque[BatchSpan] = field(default_factory=lambda: deque(maxlen=SPANS_PER_REPORT))


# -- the agent -----------------------------------------------------------------------------
class StageAgent:
    def __init__(
        self,
        parts: PoolParts,
        engine: StageEngine,
        *,
        commands: PullChannel,
        bridge: PushChannel,
        control: PushChannel,
        log,
        threads: Threads,
        regroup: Callable[[Command], PoolParts],
        pool: PoolPart | None = None,
    ) -> None:
        """``parts``: what it does in the pool it serves; ``regroup``: the parts of
        another pool, built when a ``regroup`` command says (kvasir/stage/roles.py)."""
        self.engine = engine
        self.threads = threads
        self.pool: PoolPart = pool if pool is not None else NoPool()
        self.commands = commands
        self.bridge = bridge
        self.control = control
        self.regroup = regroup
        self.index = parts.settings.index  # global: a disaggregated plan numbers both pools' stages in one sequence
        self.heartbeat = Heartbeat("stage", self.index, os.getpid())
        self.log = log
        self.clock = Clock(started=time.monotonic())
        self._take(parts)
        self._stopping = False
        self._next_stats = 0.0

    def _take(self, parts: PoolParts) -> None:
        """Serve with ``parts`` (its pool's intake, outlet and hand-off role)."""
        self.settings = parts.settings
        self.intake, self.outlet, self.handoff = parts.intake, parts.outlet, parts.handoff
        self.poller = zmq.Poller()
        for sock in [self.commands.socket, *self.intake.sockets, *self.outlet.sockets, *self.handoff.sockets]:
            self.poller.register(sock, zmq.POLLIN)

    def serve(self) -> None:
        while not self._stopping:
            self._receive()
            work = None if self.outlet.pending else self.intake.take(self.outlet.room)
            if work is not None:
                self._run(*work)
            else:
                self._wait()
            self._prefix_events()
            self.pool.events()
            self._report()

    def _receive(self) -> None:
        for command in self.commands.drain():
            if command.kind == "stop":
                self._stopping = True
            elif command.kind == "regroup":
                self._regroup(command)
        self.outlet.receive()
        self.clock.busy_s += self.handoff.receive()
        self.intake.receive()

    def _regroup(self, command: Command) -> None:
        """Its instance moves to another pool (it holds no request): serve there, and say
        Ready again. A command it cannot follow is dropped with the reason; the
        launcher's wait for its Ready then gives up on it."""
        try:
            parts = self.regroup(command)
        except RegroupError as exc:
            self.log.error("regroup refused", pool=command.pool, reason=str(exc))
            return
        self._take(parts)
        self.control.send(Ready("stage", self.index, os.getpid()))
        batch = self.settings.plan.batch
        self.log.info(
            "stage regrouped",
            pool=self.settings.pool or "mixed",
            max_rows=batch.max_rows,
            max_tokens=batch.max_tokens,
            inflight=batch.inflight,
        )

    def _run(self, descriptor: BatchDescriptor, inputs: torch.Tensor | None) -> None:
        self.clock.busy_s += self.pool.before(descriptor)  # the KV pool's spills and loads, before any row
        started = time.monotonic_ns()
        if inputs is None:
            self.engine.release(descriptor)
            self.handoff.after(descriptor)  # no rows: it only forgets the released requests
            self.outlet.emit(descriptor, None)
            return
        self.threads.follow(descriptor.solo)
        output = self.engine.run(descriptor, inputs, self.outlet.scored(descriptor))
        self.handoff.after(descriptor)
        self.intake.consumed(descriptor)
        self.outlet.emit(descriptor, output)
        ended = time.monotonic_ns()
        clock = self.clock
        clock.busy_s += (ended - started) / 1e9
        clock.batches += 1
        clock.rows += len(descriptor.rows)
        clock.tokens += descriptor.num_tokens
        decode = sum(1 for row in descriptor.rows if row.num_tokens == 1)
        clock.spans.append(BatchSpan(descriptor.batch_id, started, ended, descriptor.num_tokens - decode, decode))

    def _wait(self) -> None:
        blocked = self.outlet.pending
        started = time.monotonic()
        self.poller.poll(POLL_MS)
        waited = time.monotonic() - started
        if blocked:
            self.clock.blocked_s += waited
        else:
            self.clock.starved_s += waited
        if os.getppid() != self.settings.launcher_pid:
            self.log.warning("launcher is gone; stopping")
            self._stopping = True

    def _prefix_events(self) -> None:
        """A head tells the bridge's conductor which prefix blocks it registered and evicted."""
        events = self.intake.prefix_events()
        if events is not None:
            stored, removed, reset = events
            pid = self.heartbeat.pid
            self.bridge.send(PrefixEvents(self.index, pid, tuple(stored), tuple(removed), reset))

    def _report(self) -> None:
        now = time.monotonic()
        if now < self._next_stats and not self._stopping:
            return
        self._next_stats = now + self.settings.stats_interval_s
        self.bridge.send(self.stats(now))
        self.control.send(self.heartbeat)

    def stats(self, now: float) -> StageStats:
        c = self.clock
        cache = self.engine.cache
        return StageStats(
            index=self.index,
            layers=self.engine.spec.layers,
            pid=os.getpid(),
            host=self.settings.fabric.host if self.settings.fabric is not None else "",
            wall_s=now - c.started,
            busy_s=c.busy_s,
            starved_s=c.starved_s,
            blocked_s=c.blocked_s,
            batches=c.batches,
            rows=c.rows,
            tokens=c.tokens,
            kv=KvUse(requests=cache.requests, blocks=cache.blocks_held),
            hop_s=(self.intake.hop_ns + self.outlet.hop_ns) / 1e9,
            spans=self._take_spans(),
            pool=self.settings.pool,
            instance=self.settings.instance,
            device=str(self.engine.device),
            head=self.intake.queue(),
            prefix=self.intake.prefix(),
            drafts=self.intake.drafts() or self.outlet.drafts(),
            handoff=self.handoff.counters(),
            kv_pool=self.pool.counters(),
            experts=self._experts(),
            gpu=self._gpu_memory(),
        )

    def _experts(self) -> ExpertLoad | None:
        """MoE stages: tokens per expert, the busiest expert over the mean, dispatch time."""
        load = self.engine.expert_load()
        if not load:
            return None
        return ExpertLoad(tokens=tuple(load), imbalance=imbalance(load), dispatch_s=self.engine.dispatch.seconds)

    def _gpu_memory(self) -> GpuMemory | None:
        device = self.engine.device
        if device.type != "cuda":
            return None
        return GpuMemory(torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device))

    def _take_spans(self) -> tuple[BatchSpan, ...]:
        spans = tuple(self.clock.spans)
        self.clock.spans.clear()
        return spans
