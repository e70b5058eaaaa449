"""The stage process: build an agent from the launcher's settings (its engine, its ring's
edges, the head's scheduler or the upstream intake, the outlet, the hand-off role: the
parts that depend on its pool are kvasir/stage/roles.py's), then run it."""

from __future__ import annotations

import os
import signal
from typing import cast

import zmq

from kvasir.kvpool.stage_side import StagePool
from kvasir.logs import setup_logging
from kvasir.model.pinning import Threads, pin_process
from kvasir.model.source import resolve_source
from kvasir.ring.attach import attach_ring
from kvasir.ring.handshake import IpcRing, exchange_handles
from kvasir.ring.slots import SlotRing
from kvasir.ring.tcp_slots import FramedDescriptors, FramedIntake, TcpSlotRing
from kvasir.stage.agent import StageAgent
from kvasir.stage.engine import StageEngine
from kvasir.stage.kv_segment import KvSegmentMap
from kvasir.stage.outlets import DownstreamOutlet
from kvasir.stage.pool_peers import PeerFetcher, SliceServer
from kvasir.stage.pool_tiers import open_tiers
from kvasir.stage.pooling import MAX_QUEUED_BYTES, NoPool, Peers, PoolRole, slice_template
from kvasir.stage.ports import PoolPart
from kvasir.stage.roles import Kept, Regrouper, keep_head, keep_tail, pool_parts
from kvasir.stage.shard_links import Pulse, connect_shards
from kvasir.stage.upstream import UpstreamIntake
from kvasir.stage.wiring import Wiring
from kvasir.transport.channels import PushChannel
from kvasir.transport.fabric import Sockets, open_fabric
from kvasir.wire.batch import BatchDescriptor, Credit
from kvasir.wire.bridge import BridgeMessage
from kvasir.wire.control import Command, ControlMessage, Heartbeat, Ready, StageSettings
from kvasir.wire.experts import ExpertMessage
from kvasir.wire.head import HeadMessage

HANDSHAKE_TIMEOUT_S = 300.0  # as the launcher's start-up wait: it gives up on a stage no sooner


# -- the process -----------------------------------------------------------------------------
def build_agent(settings: StageSettings, sockets: Sockets, log) -> tuple[StageAgent, list]:
    """Wire one stage: its engine, what it keeps whichever pool it serves (its ring's
    middle, the head's scheduler, the tail's sampler), the parts of the pool it serves now
    (kvasir/stage/roles.py), its sockets. Returns the agent and what to close at the end."""
    plan = settings.plan  # a disaggregated plan's workers get their pool's view
    w = Wiring(settings, sockets, log)
    index, ends = settings.index, w.ends
    source = resolve_source(plan.model.source)
    segment = None
    if settings.handoff is not None and index in settings.handoff.segments:  # a stage that may serve prefill
        segment = KvSegmentMap(settings.handoff.segments[index], create=False)
    engine = StageEngine(plan, w.local, source, storage=(segment.keys, segment.values) if segment else None)
    commands = w.pull(Command, ends.command(f"stage-{index}"))
    control = w.push(ControlMessage, ends.control)
    closing: list = [segment] if segment else []
    if settings.shards:
        closing += _attach_shards(w, engine, control)
    kept = Kept(engine, source, w.push(BridgeMessage, ends.bridge_in))
    rings = _ends(w, kept)
    closing += rings
    if w.local == 0:
        keep_head(w, kept)
    if w.local == w.last:
        keep_tail(w, kept)
    parts = pool_parts(w, kept)
    regroup = Regrouper(w, kept, parts)
    pool = _pool(w, kept)
    closing = [pool, *closing, regroup]  # the pool first: it reads the KV cache (which may be shared memory) at close
    ipc = [cast(IpcRing, ring) for ring in rings if ring.spec.kind == "cuda-ipc"]  # CudaIpcSlotRing
    exchange_handles(ipc, index, control, commands, launcher_pid=settings.launcher_pid, timeout_s=HANDSHAKE_TIMEOUT_S)
    agent = StageAgent(
        parts,
        engine,
        commands=commands,
        bridge=kept.bridge,
        control=control,
        log=log,
        threads=Threads(plan.stages[w.local].threads, plan.stages[w.local].solo_threads),
        pool=pool,
        regroup=regroup,
    )
    return agent, closing


def _ends(w: Wiring, kept: Kept) -> list[SlotRing]:
    """The ring's edges on either side of the stage (the same in every pool): a stage
    after the head takes the previous stage's descriptors, one before the tail writes
    into the next stage's slots. Returns the attached rings (to close at the end)."""
    settings, index, ends = w.settings, w.settings.index, w.ends
    rings: list[SlotRing] = []
    if w.local > 0:
        ring_in = attach_ring(settings.edges[w.local - 1], "consumer")
        rings.append(ring_in)
        kept.upstream = UpstreamIntake(_descriptors_in(w, ring_in), ring_in, w.push(Credit, ends.credits(index - 1)))
    if w.local < w.last:
        edge = settings.edges[w.local]
        ring_out = attach_ring(edge, "producer")
        rings.append(ring_out)
        kept.downstream = DownstreamOutlet(
            _descriptors_out(w, ring_out), ring_out, w.pull(Credit, ends.credits(index)), edge.slots
        )
    return rings


def _pool(w: Wiring, kept: Kept) -> PoolPart:
    """The stage's part in the KV pool: its tiers, and its answers to its head (the head
    stage answers its own scheduler directly)."""
    settings, plan, engine, source = w.settings, w.settings.plan, kept.engine, kept.source
    if settings.kv_pool is None or plan.kv_pool is None:
        return NoPool()
    layers = engine.spec.layers
    opened = open_tiers(settings.kv_pool, source, plan.model.dtype, layers, w.log)
    template = slice_template(source, plan.model.dtype, layers, plan.kv.block_size)
    loaded = kept.pool_loaded if w.local == 0 else w.push(HeadMessage, w.ends.stage_in(w.head)).send
    pool = StagePool(
        engine.cache, opened.tiers, template, MAX_QUEUED_BYTES, secret=opened.secret, refused=opened.refused
    )
    peers = None
    if settings.fabric is not None:  # a plan across hosts: serve this host's slices, read other hosts'
        server = SliceServer(
            w.bind(zmq.ROUTER, w.ends.kvpool(settings.index)), list(opened.tiers.values()), layers, pool.size
        )
        fetcher = PeerFetcher(lambda peer: w.sockets.connect(zmq.DEALER, w.ends.kvpool(peer)), layers)
        peers = Peers(server, fetcher, plan.kv_pool.load_timeout_s)
    return PoolRole(pool, settings.index, os.getpid(), loaded, kept.bridge, w.log, peers=peers)


def _descriptors_in(w: Wiring, ring: SlotRing):
    """The upstream edge's descriptors: a typed channel, or on a tcp edge each with its boundary frame."""
    endpoint = w.ends.stage_in(w.settings.index)
    if isinstance(ring, TcpSlotRing):
        return FramedIntake(w.bind(zmq.PULL, endpoint), ring)
    return w.pull(BatchDescriptor, endpoint)


def _descriptors_out(w: Wiring, ring: SlotRing):
    endpoint = w.ends.stage_in(w.settings.index + 1)
    if isinstance(ring, TcpSlotRing):
        return FramedDescriptors(w.connect(zmq.PUSH, endpoint), ring)
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
