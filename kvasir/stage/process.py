"""The stage process: build an agent from the launcher's settings (sockets, rings, the
head's scheduler or the upstream intake, the outlet, the hand-off role), then run it."""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from typing import cast

import zmq

from kvasir.errors import KvasirError
from kvasir.kvpool.stage_side import StagePool
from kvasir.logs import Logger, setup_logging
from kvasir.model.pinning import Threads, pin_process
from kvasir.model.source import ModelSource, resolve_source
from kvasir.ring.attach import attach_ring
from kvasir.ring.handshake import IpcRing, exchange_handles
from kvasir.ring.slots import SlotRing
from kvasir.ring.tcp_slots import FramedDescriptors, FramedIntake, TcpSlotRing
from kvasir.sched.scheduler import Scheduler
from kvasir.stage.agent import StageAgent
from kvasir.stage.decode_head import DecodeHeadIntake
from kvasir.stage.drafting import model_drafter
from kvasir.stage.engine import StageEngine
from kvasir.stage.grammar import Grammars
from kvasir.stage.handoff import HandoffSender, KvReceiver, NoHandoff, overlap
from kvasir.stage.heads import PrefillHeadIntake, SchedulerIntake
from kvasir.stage.kv_remote import KvInbox, KvStream
from kvasir.stage.kv_segment import KvSegmentMap
from kvasir.stage.outlets import DownstreamOutlet, PrefillTailOutlet, TailOutlet
from kvasir.stage.pool_peers import PeerFetcher, SliceServer
from kvasir.stage.pooling import MAX_QUEUED_BYTES, LoadWaits, NoPool, Peers, PoolRole, open_tiers, slice_template
from kvasir.stage.ports import HandoffRole, Intake, Outlet, PoolPart
from kvasir.stage.sampling import Sampler
from kvasir.stage.shard_links import Pulse, connect_shards
from kvasir.stage.upstream import UpstreamIntake
from kvasir.transport.channels import Endpoints, PullChannel, PushChannel
from kvasir.transport.fabric import Sockets, open_fabric
from kvasir.wire.batch import BatchDescriptor, Credit
from kvasir.wire.bridge import BridgeMessage
from kvasir.wire.control import Command, ControlMessage, HandoffWiring, Heartbeat, Ready, StageSettings
from kvasir.wire.experts import ExpertMessage
from kvasir.wire.head import HeadMessage
from kvasir.wire.kv import KvMessage

HANDSHAKE_TIMEOUT_S = 300.0  # as the launcher's start-up wait: it gives up on a stage no sooner


# -- the process -----------------------------------------------------------------------------
@dataclass
class Wiring:
    """A stage's place: its index in its pool's ring, its global index, its sockets' context."""

    settings: StageSettings
    sockets: Sockets
    log: Logger

    @property
    def ends(self) -> Endpoints:
        return self.sockets.ends

    @property
    def local(self) -> int:
        return self.settings.index - self.settings.first

    @property
    def last(self) -> int:
        return len(self.settings.plan.stages) - 1

    @property
    def head(self) -> int:
        return self.settings.first

    @property
    def handoff(self) -> HandoffWiring:
        """A pool's hand-off wiring (the launcher gives it to every stage of a disaggregated plan)."""
        if self.settings.handoff is None:
            raise KvasirError(f"stage {self.settings.index} of the {self.settings.pool} pool has no hand-off wiring")
        return self.settings.handoff

    def others(self, heads: list[int]) -> list[int]:
        """Of ``heads``, the other instances' (a movable instance is in both pools' lists)."""
        return [head for head in heads if head != self.head]

    def push(self, kind, endpoint: str) -> PushChannel:
        return PushChannel[kind](self.sockets.connect(zmq.PUSH, endpoint))

    def pull(self, kind, endpoint: str) -> PullChannel:
        return PullChannel[kind](self.sockets.bind(zmq.PULL, endpoint), kind, self.log)


def build_agent(settings: StageSettings, sockets: Sockets, log) -> tuple[StageAgent, list]:
    """Wire one stage: its engine, its intake and outlet (chosen by position and pool),
    its hand-off role, its sockets. Returns the agent and what to close at the end."""
    plan = settings.plan  # a disaggregated plan's workers get their pool's view
    w = Wiring(settings, sockets, log)
    index, ends = settings.index, w.ends
    source = resolve_source(plan.model.source)
    segment = None
    if settings.handoff is not None and index in settings.handoff.segments:  # a stage that may serve prefill
        segment = KvSegmentMap(settings.handoff.segments[index], create=False)
    engine = StageEngine(plan, w.local, source, storage=(segment.keys, segment.values) if segment else None)
    bridge = w.push(BridgeMessage, ends.bridge_in)
    commands = w.pull(Command, ends.command(f"stage-{index}"))
    control = w.push(ControlMessage, ends.control)
    closing: list = [segment] if segment else []
    if settings.shards:
        closing += _attach_shards(w, engine, control)
    rings: list[SlotRing] = []
    if w.local == 0:
        decoding = settings.pool != "prefill"
        drafter = model_drafter(plan, engine.device, drafting=decoding)
        scheduler = Scheduler(plan, source.vocab_size, reserve_output=decoding, drafter=drafter)
        intake: Intake = _head_intake(w, scheduler, bridge)
    else:
        ring_in = attach_ring(settings.edges[w.local - 1], "consumer")
        closing.append(ring_in)
        rings.append(ring_in)
        intake = UpstreamIntake(_descriptors_in(w, ring_in), ring_in, w.push(Credit, ends.credits(index - 1)))
    if w.local == w.last:
        sampler, head = (
            Sampler(
                source.eos_token_ids,
                plan.model.max_seq_len,
                Grammars(source.weights_dir, source.vocab_size),
                speculative=plan.speculative is not None and settings.pool != "prefill",
            ),
            w.push(HeadMessage, ends.stage_in(w.head)),
        )
        if settings.pool == "prefill":
            outlet: Outlet = PrefillTailOutlet(
                sampler, head, bridge, _heads(w, w.others(w.handoff.decode_heads)), settings.first
            )
        else:
            outlet = TailOutlet(sampler, head, bridge)
    else:
        edge = settings.edges[w.local]
        ring_out = attach_ring(edge, "producer")
        closing.append(ring_out)
        rings.append(ring_out)
        outlet = DownstreamOutlet(
            _descriptors_out(w, ring_out), ring_out, w.pull(Credit, ends.credits(index)), edge.slots
        )
    handoff = _handoff(w, engine)
    pool = _pool(w, engine, source, intake, bridge)
    closing = [pool, *closing, handoff]  # the pool first: it reads the KV cache (which may be shared memory) at close
    ipc = [cast(IpcRing, ring) for ring in rings if ring.spec.kind == "cuda-ipc"]  # CudaIpcSlotRing
    exchange_handles(ipc, index, control, commands, launcher_pid=settings.launcher_pid, timeout_s=HANDSHAKE_TIMEOUT_S)
    agent = StageAgent(
        settings,
        engine,
        intake,
        outlet,
        commands=commands,
        bridge=bridge,
        control=control,
        log=log,
        threads=Threads(plan.stages[w.local].threads, plan.stages[w.local].solo_threads),
        handoff=handoff,
        pool=pool,
    )
    return agent, closing


def _pool(w: Wiring, engine: StageEngine, source: ModelSource, intake: Intake, bridge: PushChannel) -> PoolPart:
    """The stage's part in the KV pool: its tiers, and its answers to its head (the head
    stage answers its own intake directly)."""
    settings, plan = w.settings, w.settings.plan
    if settings.kv_pool is None or plan.kv_pool is None:
        return NoPool()
    layers = engine.spec.layers
    tiers = open_tiers(settings.kv_pool, source, plan.model.dtype, layers)
    template = slice_template(source, plan.model.dtype, layers, plan.kv.block_size)
    if isinstance(intake, SchedulerIntake):
        loaded = intake.pool_loaded
    else:
        loaded = w.push(HeadMessage, w.ends.stage_in(w.head)).send
    pool = StagePool(engine.cache, tiers, template, MAX_QUEUED_BYTES)
    peers = None
    if settings.fabric is not None:  # a plan across hosts: serve this host's slices, read other hosts'
        server = SliceServer(
            w.sockets.bind(zmq.ROUTER, w.ends.kvpool(settings.index)), [t.folder for t in tiers.values()], layers
        )
        fetcher = PeerFetcher(lambda peer: w.sockets.connect(zmq.DEALER, w.ends.kvpool(peer)), layers)
        peers = Peers(server, fetcher, plan.kv_pool.load_timeout_s)
    return PoolRole(pool, settings.index, os.getpid(), loaded, bridge, w.log, peers=peers)


def _descriptors_in(w: Wiring, ring: SlotRing):
    """The upstream edge's descriptors: a typed channel, or on a tcp edge each with its boundary frame."""
    endpoint = w.ends.stage_in(w.settings.index)
    if isinstance(ring, TcpSlotRing):
        return FramedIntake(w.sockets.bind(zmq.PULL, endpoint), ring)
    return w.pull(BatchDescriptor, endpoint)


def _descriptors_out(w: Wiring, ring: SlotRing):
    endpoint = w.ends.stage_in(w.settings.index + 1)
    if isinstance(ring, TcpSlotRing):
        return FramedDescriptors(w.sockets.connect(zmq.PUSH, endpoint), ring)
    return w.push(BatchDescriptor, endpoint)


def _attach_shards(w: Wiring, engine: StageEngine, control: PushChannel) -> list:
    """Run the stage's experts on its shard processes; the dispatch slots to close."""
    settings = w.settings
    pulse = Pulse(control, Heartbeat("stage", settings.index, os.getpid()), settings.stats_interval_s)
    shards, slots = connect_shards(
        settings.shards,
        w.pull(ExpertMessage, w.ends.experts_out(settings.index)),
        lambda number: w.push(ExpertMessage, w.ends.shard_in(number)),
        pulse,
        2 * settings.plan.supervise.heartbeat_timeout_s,  # a hung shard is found silent, and named, first
        engine.device,
    )
    engine.attach(list(shards))
    return slots


def _head_intake(w: Wiring, scheduler: Scheduler, bridge: PushChannel) -> Intake:
    settings, ends = w.settings, w.ends
    inbox = w.pull(HeadMessage, ends.stage_in(settings.index))
    if settings.pool == "prefill":
        decoders = _heads(w, w.others(w.handoff.decode_heads))
        return PrefillHeadIntake(scheduler, inbox, bridge, decoders, w.handoff.lease_s)
    if settings.pool == "decode":
        mine = range(settings.first, settings.first + len(settings.plan.stages))
        stages = [w.push(KvMessage, ends.kv_in(k)) for k in mine]
        return DecodeHeadIntake(scheduler, inbox, bridge, _heads(w, w.others(w.handoff.prefill_heads)), stages)
    pool = settings.plan.kv_pool
    loads = (
        LoadWaits(range(settings.first, settings.first + len(settings.plan.stages)), pool.load_timeout_s)
        if pool
        else None
    )
    return SchedulerIntake(scheduler, inbox, bridge, loads)


def _heads(w: Wiring, heads: list[int]) -> dict[int, PushChannel]:
    """Push channels to other instances' heads, by their global index."""
    return {head: w.push(HeadMessage, w.ends.stage_in(head)) for head in heads}


def _handoff(w: Wiring, engine: StageEngine) -> HandoffRole:
    settings, ends = w.settings, w.ends
    layers = engine.spec.layers
    if settings.pool == "prefill":
        return _sender(w, engine)
    if settings.pool == "decode":
        inbox = KvInbox(w.pull(KvMessage, ends.kv_in(settings.index)), engine.cache, settings.plan.model.max_seq_len)
        head = w.push(HeadMessage, ends.stage_in(settings.first))
        return KvReceiver(
            settings.index, layers, engine.cache, w.handoff, inbox, head, expiry_s=settings.plan.handoff.lease_s
        )
    return NoHandoff()


def _sender(w: Wiring, engine: StageEngine) -> HandoffSender:
    """A prefill stage's hand-off: per decode instance, its stages sharing layers with this
    one (on this host: they copy from this stage's segment; elsewhere: streamed)."""
    wiring, layers, index = w.handoff, engine.spec.layers, w.settings.index
    heads = w.others(wiring.decode_heads)
    targets: dict[int, list[PushChannel]] = {head: [] for head in heads}
    streams: dict[int, list[KvStream]] = {head: [] for head in heads}
    for head in heads:
        for target in wiring.ring_of(head):
            span = overlap(layers, wiring.layers[target])
            if span is None:
                continue
            if wiring.hosts and wiring.hosts[target] != wiring.hosts[index]:
                socket = w.sockets.connect(zmq.PUSH, w.ends.kv_in(target))
                streams[head].append(KvStream(socket, engine.cache, layers, span))
            else:
                targets[head].append(w.push(KvMessage, w.ends.kv_in(target)))
    return HandoffSender(index, layers, engine.cache, targets, streams)


def run_stage(settings: StageSettings) -> None:
    """Entry point of a stage worker process (spawned by the launcher)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)  # the launcher owns shutdown (a group-wide signal must not kill us)
    log = setup_logging(settings.log_level, role="stage", index=settings.index, pid=os.getpid())
    closing: list = []
    sockets = None
    try:
        stage = settings.plan.stages[settings.index - settings.first]
        pin_process(stage.device, stage.threads, stage.cpus)
        sockets = Sockets(zmq.Context(), *open_fabric(settings.runtime_dir, settings.fabric))
        agent, closing = build_agent(settings, sockets, log)
        agent.pool.events()  # what its KV pool tiers hold, before the first request can be routed
        agent.control.send(Ready("stage", settings.index, os.getpid()))
        stored = agent.engine.model.slice.stored  # GGUF matrices served as stored (kvasir/model/quant/)
        log.info(
            "stage ready",
            layers=list(agent.engine.spec.layers),
            pool=settings.pool or None,
            dtype=settings.plan.model.dtype,
            stored=dict(stored.formats) if stored.layers else None,
            stored_mib=round(stored.stored_bytes / 2**20, 1) if stored.layers else None,
        )
        agent.serve()
        log.info("stage stopped")
    except Exception:
        log.exception("stage failed")
        raise SystemExit(1) from None
    finally:
        for resource in closing:
            resource.close()
        if sockets is not None:
            sockets.end()
