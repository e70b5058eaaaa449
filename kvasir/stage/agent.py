"""The stage agent: one process, one slice, a plain synchronous loop around torch.

Where a stage's work comes from (the head's scheduler, or the upstream stage's
descriptors) and where it goes (the downstream stage's slots, or the tail's sampler)
is chosen once at construction; the loop itself never branches on topology.
"""

from __future__ import annotations

import os
import signal
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import msgspec
import torch
import zmq

from kvasir.config.devices import cuda_ordinal
from kvasir.stage.engine import StageEngine
from kvasir.ring.handshake import exchange_handles
from kvasir.stage.handoff import HandoffSender, KvReceiver, NoHandoff, overlap
from kvasir.stage.heads import DecodeHeadIntake, PrefillHeadIntake, SchedulerIntake, Work
from kvasir.logs import setup_logging
from kvasir.wire.batch import BatchDescriptor, Credit
from kvasir.wire.head import BatchResult, Handoff, HeadMessage
from kvasir.wire.bridge import BatchSpan, BridgeMessage, StageStats, TokenEvents
from kvasir.wire.control import Command, ControlMessage, Heartbeat, Ready, WorkerSettings
from kvasir.wire.kv import KvMessage
from kvasir.model.source import resolve_source
from kvasir.stage.sampling import Sampler
from kvasir.sched.scheduler import Scheduler
from kvasir.stage.kv_segment import KvSegmentMap
from kvasir.ring.slots import SlotCredits, SlotError, SlotRing
from kvasir.ring.attach import attach_ring
from kvasir.wire.transport import Endpoints, PullChannel, PushChannel, make_socket

POLL_MS = 50
HANDSHAKE_TIMEOUT_S = 300.0  # as the launcher's start-up wait: it gives up on a stage no sooner
SPANS_PER_REPORT = 2048  # batch spans a stage keeps between two stats reports


class Intake(Protocol):
    """Where a stage's batches come from."""

    sockets: list[zmq.Socket]

    def receive(self) -> None: ...

    def take(self, room: bool) -> Work | None: ...

    def consumed(self, descriptor: BatchDescriptor) -> None: ...

    def counters(self) -> dict[str, int]: ...

    hop_ns: int  # time spent on boundary hand-offs (reading slots, descriptors, credits)


class HandoffRole(Protocol):
    """What a stage does for the KV hand-off between pools (nothing in a colocated plan)."""

    sockets: list[zmq.Socket]
    nbytes: int  # KV bytes received
    copy_s: float  # seconds spent copying them

    def receive(self) -> float: ...  # seconds of work done

    def after(self, descriptor: BatchDescriptor) -> None: ...

    def close(self) -> None: ...


class Outlet(Protocol):
    """Where a stage's outputs go."""

    sockets: list[zmq.Socket]

    @property
    def room(self) -> bool: ...

    @property
    def pending(self) -> bool: ...

    def receive(self) -> None: ...

    def emit(self, descriptor: BatchDescriptor, output: torch.Tensor | None) -> None: ...

    hop_ns: int  # time spent on boundary hand-offs (writing slots, descriptors, credits)


@dataclass
class Clock:
    """Busy, starved and blocked seconds, and what passed through (DESIGN.md section 5)."""

    started: float
    busy_s: float = 0.0
    starved_s: float = 0.0
    blocked_s: float = 0.0
    batches: int = 0
    rows: int = 0
    tokens: int = 0
    spans: deque[BatchSpan] = field(default_factory=lambda: deque(maxlen=SPANS_PER_REPORT))


# -- every other stage: batches come from upstream ----------------------------------------
class UpstreamIntake:
    def __init__(self, descriptors: PullChannel, ring: SlotRing, credits: PushChannel) -> None:
        self.descriptors = descriptors
        self.ring = ring
        self.credits = credits
        self.sockets = [descriptors.socket]
        self._queue: deque[BatchDescriptor] = deque()
        self.hop_ns = 0

    def receive(self) -> None:
        started = time.perf_counter_ns()
        arrived = self.descriptors.drain()
        if arrived:
            self._queue.extend(d for d in arrived if self._fits(d))
            self.hop_ns += time.perf_counter_ns() - started

    def _fits(self, descriptor: BatchDescriptor) -> bool:
        """A descriptor whose slot and token counts fit this edge (anything else cannot
        have come from the upstream stage: dropped, and the ring keeps its own order)."""
        spec = self.ring.spec
        total = sum(row.num_tokens for row in descriptor.rows)
        if descriptor.rows:
            fits = 0 <= descriptor.slot < spec.slots and 0 < total == descriptor.num_tokens <= spec.max_tokens
        else:
            fits = descriptor.num_tokens == 0
        if not fits:
            self.descriptors.drop(f"descriptor of batch {descriptor.batch_id} does not fit the edge (slot {descriptor.slot}, {descriptor.num_tokens} tokens)")
        return fits

    def take(self, room: bool) -> Work | None:
        if not self._queue:
            return None
        descriptor = self._queue.popleft()
        if not descriptor.rows:
            return descriptor, None
        started = time.perf_counter_ns()
        boundary = self.ring.read(descriptor.slot, descriptor.num_tokens)
        self.hop_ns += time.perf_counter_ns() - started
        return descriptor, boundary

    def consumed(self, descriptor: BatchDescriptor) -> None:
        if descriptor.rows:
            started = time.perf_counter_ns()
            self.ring.release(descriptor.slot)
            self.credits.send(Credit(descriptor.slot))
            self.hop_ns += time.perf_counter_ns() - started

    def counters(self) -> dict[str, int]:
        return {"inflight": 0, "waiting": 0}


# -- outputs -------------------------------------------------------------------------------
class DownstreamOutlet:
    """Writes boundaries into the next stage's slots, in order, waiting for credits."""

    def __init__(self, descriptors: PushChannel, ring: SlotRing, credits: PullChannel, slots: int) -> None:
        self.descriptors = descriptors
        self.ring = ring
        self.credit_channel = credits
        self.credits = SlotCredits(slots)
        self.sockets = [credits.socket]
        self._pending: deque[Work] = deque()
        self.hop_ns = 0

    @property
    def room(self) -> bool:
        return self.credits.available and not self._pending

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def receive(self) -> None:
        started = time.perf_counter_ns()
        credits = self.credit_channel.drain()
        for credit in credits:
            try:
                self.credits.give_back(credit.slot)
            except SlotError as exc:  # not from the consumer, which returns each slot once
                self.credit_channel.drop(str(exc))
        if credits:
            self.hop_ns += time.perf_counter_ns() - started
        self._flush()

    def emit(self, descriptor: BatchDescriptor, output: torch.Tensor | None) -> None:
        self._pending.append((descriptor, output))
        self._flush()

    def _flush(self) -> None:
        while self._pending:
            descriptor, output = self._pending[0]
            if output is not None and not self.credits.available:
                return
            started = time.perf_counter_ns()
            if output is not None:
                slot = self.credits.take()
                self.ring.write(slot, output)
                descriptor = msgspec.structs.replace(descriptor, slot=slot)
            self._pending.popleft()
            self.descriptors.send(descriptor)
            self.hop_ns += time.perf_counter_ns() - started


class TailOutlet:
    """Samples, sends the tokens back to the head and the token events to the bridge."""

    def __init__(self, sampler: Sampler, head: PushChannel, bridge: PushChannel) -> None:
        self.sampler = sampler
        self.head = head
        self.bridge = bridge
        self.sockets: list[zmq.Socket] = []

    room = True
    pending = False
    hop_ns = 0  # sampled tokens going back to the head are not a boundary hand-off

    def receive(self) -> None:
        pass

    def emit(self, descriptor: BatchDescriptor, output: torch.Tensor | None) -> None:
        if output is None:
            self.sampler.sample(descriptor, torch.empty(0, 0))
            return
        result = self.sampler.sample(descriptor, output)
        self.sampled(descriptor, result)
        self.head.send(result)
        if result.tokens:
            self.bridge.send(TokenEvents(result.tokens))

    def sampled(self, descriptor: BatchDescriptor, result: BatchResult) -> None:
        """Called with each batch's tokens before they go out (the prefill tail hands requests on)."""


class PrefillTailOutlet(TailOutlet):
    """The prefill pool's tail: as a tail, and every request whose first token is not its
    last goes straight to the decode head (its KV is already on its way)."""

    def __init__(self, sampler: Sampler, head: PushChannel, bridge: PushChannel, decode_head: PushChannel) -> None:
        super().__init__(sampler, head, bridge)
        self.decode_head = decode_head

    def sampled(self, descriptor: BatchDescriptor, result: BatchResult) -> None:
        lengths = {row.request_id: row.start + row.num_tokens for row in descriptor.rows if row.emit}
        now = time.monotonic_ns()
        for token in result.tokens:
            if token.finish is None:
                sampling, seed = self.sampler.spec(token.request_id)
                self.decode_head.send(Handoff(token.request_id, lengths[token.request_id], token.token_id, sampling, seed, now))


# -- the agent -----------------------------------------------------------------------------
class StageAgent:
    def __init__(
        self,
        settings: WorkerSettings,
        engine: StageEngine,
        intake: Intake,
        outlet: Outlet,
        commands: PullChannel,
        bridge: PushChannel,
        control: PushChannel,
        log,
        handoff: HandoffRole = NoHandoff(),
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.intake = intake
        self.outlet = outlet
        self.handoff = handoff
        self.commands = commands
        self.bridge = bridge
        self.control = control
        self.index = settings.index  # global: a disaggregated plan numbers both pools' stages in one sequence
        self.heartbeat = Heartbeat("stage", self.index, os.getpid())
        self.log = log
        self.clock = Clock(started=time.monotonic())
        self.poller = zmq.Poller()
        for sock in [commands.socket, *intake.sockets, *outlet.sockets, *handoff.sockets]:
            self.poller.register(sock, zmq.POLLIN)
        self._stopping = False
        self._next_stats = 0.0

    def serve(self) -> None:
        while not self._stopping:
            self._receive()
            work = None if self.outlet.pending else self.intake.take(self.outlet.room)
            if work is not None:
                self._run(*work)
            else:
                self._wait()
            self._report()

    def _receive(self) -> None:
        for command in self.commands.drain():
            if command.kind == "stop":
                self._stopping = True
        self.outlet.receive()
        self.clock.busy_s += self.handoff.receive()
        self.intake.receive()

    def _run(self, descriptor: BatchDescriptor, inputs: torch.Tensor | None) -> None:
        started = time.monotonic_ns()
        if inputs is None:
            self.engine.release(descriptor)
            self.outlet.emit(descriptor, None)
            return
        output = self.engine.run(descriptor, inputs)
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
        counters = self.intake.counters()
        return StageStats(
            index=self.index,
            layers=self.engine.spec.layers,
            pid=os.getpid(),
            wall_s=now - c.started,
            busy_s=c.busy_s,
            starved_s=c.starved_s,
            blocked_s=c.blocked_s,
            batches=c.batches,
            rows=c.rows,
            tokens=c.tokens,
            inflight=counters["inflight"],
            waiting=counters["waiting"],
            kv_requests=cache.requests,
            kv_blocks=cache.blocks_held,
            hop_s=(self.intake.hop_ns + self.outlet.hop_ns) / 1e9,
            spans=self._take_spans(),
            pool=self.settings.pool,
            handoff_bytes=self.handoff.nbytes,
            handoff_s=self.handoff.copy_s,
            handing_off=counters.get("handing_off", 0),
            **self._device_memory(),
        )

    def _device_memory(self) -> dict:
        device = self.engine.device
        if device.type != "cuda":
            return {}
        return {
            "device": str(device),
            "gpu_bytes": torch.cuda.memory_allocated(device),
            "gpu_reserved_bytes": torch.cuda.memory_reserved(device),
        }

    def _take_spans(self) -> tuple[BatchSpan, ...]:
        spans = tuple(self.clock.spans)
        self.clock.spans.clear()
        return spans


# -- the process -----------------------------------------------------------------------------
@dataclass
class Wiring:
    """A stage's place: its index in its pool's ring, its global index, its sockets' context."""

    settings: WorkerSettings
    ctx: zmq.Context
    ends: Endpoints
    log: object = None

    @property
    def local(self) -> int:
        return self.settings.index - self.settings.first

    @property
    def last(self) -> int:
        return len(self.settings.plan.stages) - 1

    @property
    def head(self) -> int:
        return self.settings.first

    def push(self, kind, endpoint: str) -> PushChannel:
        return PushChannel[kind](make_socket(self.ctx, zmq.PUSH, connect=endpoint))

    def pull(self, kind, endpoint: str) -> PullChannel:
        return PullChannel[kind](make_socket(self.ctx, zmq.PULL, bind=endpoint), kind, self.log)


def build_agent(settings: WorkerSettings, ctx: zmq.Context, log) -> tuple[StageAgent, list]:
    """Wire one stage: its engine, its intake and outlet (chosen by position and pool),
    its hand-off role, its sockets. Returns the agent and what to close at the end."""
    plan = settings.plan  # a disaggregated plan's workers get their pool's view
    w = Wiring(settings, ctx, Endpoints(settings.runtime_dir), log)
    index, ends = settings.index, w.ends
    source = resolve_source(plan.model.source)
    segment = None
    if settings.pool == "prefill":
        segment = KvSegmentMap(settings.handoff.prefill[w.local], create=False)
    engine = StageEngine(plan, w.local, source, storage=(segment.keys, segment.values) if segment else None)
    bridge = w.push(BridgeMessage, ends.bridge_in)
    commands = w.pull(Command, ends.command(f"stage-{index}"))
    control = w.push(ControlMessage, ends.control)
    closing: list = [segment] if segment else []
    rings: list[SlotRing] = []
    if w.local == 0:
        scheduler = Scheduler(plan, source.vocab_size, reserve_output=settings.pool != "prefill")
        intake: Intake = _head_intake(w, scheduler, bridge)
    else:
        ring_in = attach_ring(settings.edges[w.local - 1], "consumer")
        closing.append(ring_in)
        rings.append(ring_in)
        intake = UpstreamIntake(w.pull(BatchDescriptor, ends.stage_in(index)), ring_in, w.push(Credit, ends.credits(index - 1)))
    if w.local == w.last:
        sampler, head = Sampler(source.eos_token_ids, plan.model.max_seq_len), w.push(HeadMessage, ends.stage_in(w.head))
        if settings.pool == "prefill":
            decode_head = w.push(HeadMessage, ends.stage_in(settings.handoff.decode_head))
            outlet: Outlet = PrefillTailOutlet(sampler, head, bridge, decode_head)
        else:
            outlet = TailOutlet(sampler, head, bridge)
    else:
        edge = settings.edges[w.local]
        ring_out = attach_ring(edge, "producer")
        closing.append(ring_out)
        rings.append(ring_out)
        outlet = DownstreamOutlet(
            w.push(BatchDescriptor, ends.stage_in(index + 1)), ring_out, w.pull(Credit, ends.credits(index)), edge.slots
        )
    handoff = _handoff(w, engine)
    closing.append(handoff)
    ipc = [ring for ring in rings if ring.spec.kind == "cuda-ipc"]
    exchange_handles(ipc, index, control, commands, settings.launcher_pid, HANDSHAKE_TIMEOUT_S)
    return StageAgent(settings, engine, intake, outlet, commands, bridge, control, log, handoff), closing


def _head_intake(w: Wiring, scheduler: Scheduler, bridge: PushChannel) -> Intake:
    settings, ends = w.settings, w.ends
    inbox = w.pull(HeadMessage, ends.stage_in(settings.index))
    if settings.pool == "prefill":
        decode_head = w.push(HeadMessage, ends.stage_in(settings.handoff.decode_head))
        return PrefillHeadIntake(scheduler, inbox, bridge, decode_head, settings.handoff.lease_s)
    if settings.pool == "decode":
        first = settings.handoff.decode_head
        stages = [w.push(KvMessage, ends.kv_in(first + j)) for j in range(len(settings.handoff.decode))]
        return DecodeHeadIntake(scheduler, inbox, bridge, w.push(HeadMessage, ends.stage_in(0)), stages)
    return SchedulerIntake(scheduler, inbox, bridge)


def _handoff(w: Wiring, engine: StageEngine) -> HandoffRole:
    settings, ends, wiring = w.settings, w.ends, w.settings.handoff
    layers = engine.spec.layers
    if settings.pool == "prefill":
        first = wiring.decode_head
        targets = [
            w.push(KvMessage, ends.kv_in(first + j)) for j, theirs in enumerate(wiring.decode) if overlap(layers, theirs)
        ]
        return HandoffSender(settings.index, layers, engine.cache, targets)
    if settings.pool == "decode":
        inbox = w.pull(KvMessage, ends.kv_in(settings.index))
        return KvReceiver(settings.index, layers, engine.cache, wiring, inbox, w.push(HeadMessage, ends.stage_in(wiring.decode_head)))
    return NoHandoff()


def pin_worker(settings: WorkerSettings) -> None:
    """Torch threads, CPU affinity and CUDA device from the plan's stage entry."""
    stage = settings.plan.stages[settings.index - settings.first]
    torch.set_num_threads(stage.threads)
    if stage.cpus is not None:
        os.sched_setaffinity(0, stage.cpus)
    ordinal = cuda_ordinal(stage.device)
    if ordinal is not None:
        torch.cuda.set_device(ordinal)  # once, before anything touches CUDA: plain "cuda" is device 0


def run_stage(encoded: bytes) -> None:
    """Entry point of a stage worker process (spawned by the launcher)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)  # the launcher owns shutdown (a group-wide signal must not kill us)
    settings = msgspec.msgpack.decode(encoded, type=WorkerSettings)
    log = setup_logging(settings.log_level, role="stage", index=settings.index, pid=os.getpid())
    ctx = zmq.Context()
    closing: list = []
    try:
        pin_worker(settings)
        agent, closing = build_agent(settings, ctx, log)
        agent.control.send(Ready("stage", settings.index, os.getpid()))
        log.info("stage ready", layers=list(agent.engine.spec.layers), pool=settings.pool or None)
        agent.serve()
        log.info("stage stopped")
    except Exception:
        log.exception("stage failed")
        raise SystemExit(1)
    finally:
        for resource in closing:
            resource.close()
        ctx.destroy(linger=0)
