"""The shared memory a daemon lays out before spawning anything: each pool's edges (slot
rings of the kind kvasir/ring/edges.py picks; shared-memory ones are created here, CUDA
IPC edges are paired at each start, ``tcp`` edges between hosts need nothing made), each
expert shard's dispatch slot and, in a disaggregated plan, the prefill stages' KV caches
that decode stages copy handed-off requests from.

In a plan across hosts every segment belongs to the host of the workers that map it:
the launcher lays out the whole plan, creates its own host's segments, and hands each
follower (``kvasird join``) the specs of its host's (``Layout.hosted``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from kvasir.config.devices import dispatch_kind
from kvasir.config.plan import Plan
from kvasir.config.roles import MOVABLE_POOLS, pool_batch, widest
from kvasir.config.sections import Pool
from kvasir.daemon.children import ChildId, StagePlace
from kvasir.errors import KvasirError
from kvasir.model.source import ModelSource
from kvasir.ring.attach import SHARED_MEMORY_KINDS, create_ring
from kvasir.ring.edges import pool_edges, torch_peer_access
from kvasir.ring.expert_slots import DispatchSegment
from kvasir.ring.slots import ShmSlotRing
from kvasir.stage.kv_segment import KvSegmentMap
from kvasir.transport.routes import Placement
from kvasir.wire.base import Role
from kvasir.wire.control import DispatchSlot, EdgeSpec, HandoffWiring, HostSegments, KvSegment, ShardWiring


class LayoutError(KvasirError):
    """An edge the plan asks for cannot be made on this host."""


@dataclass
class Layout:
    places: list[StagePlace] = field(default_factory=list)  # per global stage index
    shards: list[ShardWiring] = field(default_factory=list)  # per shard number
    rings: list[ShmSlotRing | KvSegmentMap | DispatchSegment] = field(default_factory=list)  # the launcher's
    ipc_edges: dict[str, tuple[int, int]] = field(default_factory=dict)  # edge name -> (producer, consumer)
    wiring: HandoffWiring | None = None  # disaggregated plans: the prefill caches
    hosted: dict[str | None, HostSegments] = field(default_factory=dict)  # what each host makes

    def segments(self, host: str | None) -> HostSegments:
        return self.hosted.setdefault(host, HostSegments())

    def place_of(self, role: Role, index: int, plan: Plan) -> tuple[StagePlace, list[ShardWiring]]:
        """Where a child sits and the expert shards it deals with: a stage's place and its
        shards; a shard's stage's place and itself; the bridge: the whole plan, none."""
        if role == "stage":
            place = self.places[index]
            return place, place.shards
        if role == "shard":
            shard = self.shards[index]
            return self.places[shard.stage], [shard]
        return StagePlace("", plan, 0, [], ""), []

    def ring_ids(self) -> dict[str, list[ChildId]]:
        """Each instance's children, by its name: its stages (in ring order), then their expert shards."""
        rings: dict[str, list[ChildId]] = {}
        for k, place in enumerate(self.places):
            rings.setdefault(place.instance, []).append(ChildId("stage", k, place.pool, place.instance))
        for k, shard in enumerate(self.shards):
            place = self.places[shard.stage]
            rings[place.instance].append(ChildId("shard", k, place.pool, place.instance))
        return rings

    def close(self) -> None:
        """Unmap and remove every shared-memory file made here."""
        for ring in self.rings:
            ring.close()
            ring.unlink()
        self.rings = []


def lay_out(plan: Plan, source: ModelSource, prefix: str, log) -> Layout:
    """Lay out every edge (and the prefill caches), named from ``prefix``, and create the
    shared memory of this host's workers (the leader's, in a plan across hosts). On
    failure, whatever was already created is removed before the error goes on."""
    layout = Layout()
    placement = Placement.of(plan)
    _edges(plan, source, prefix, log, layout, placement)
    _shards(source, prefix, layout, placement)
    if plan.disaggregated:
        layout.wiring = _kv_segments(plan, source, prefix, layout, placement)
    layout.rings = make_segments(layout.segments(placement.leader))
    return layout


def pool_view(plan: Plan, ring: Plan, pool: Pool) -> Plan:
    """A movable instance's ring in ``pool``: that pool's widths (its cache is the same in
    every pool); in the mixed role ("": both phases, as a colocated ring) the widest."""
    return msgspec.structs.replace(ring, batch=pool_batch(plan, pool) if pool else widest(plan))


def make_segments(segments: HostSegments) -> list[ShmSlotRing | KvSegmentMap | DispatchSegment]:
    """Create one host's shared memory; on failure what was made is removed first."""
    made: list[ShmSlotRing | KvSegmentMap | DispatchSegment] = []
    try:
        for edge in segments.edges:
            made.append(create_ring(edge))
        for slot in segments.slots:
            made.append(DispatchSegment(slot, create=True))
        for kv in segments.kv:
            made.append(KvSegmentMap(kv, create=True))
    except BaseException:
        Layout(rings=made).close()
        raise
    return made


def _edges(plan: Plan, source: ModelSource, prefix: str, log, layout: Layout, placement: Placement) -> None:
    peer_access = torch_peer_access(plan.all_stages)
    for ring in plan.rings():
        view, first = ring.plan, ring.first
        widths = widest(plan) if ring.movable else view.batch  # a movable instance's edges fit every pool's
        edges = []
        hosts = list(placement.stages[first : first + len(view.stages)])
        for k, choice in enumerate(pool_edges(view.stages, peer_access, hosts)):
            kind = choice.kind
            if kind == "auto":
                raise LayoutError(f"edge {first + k} -> {first + k + 1}: {choice.reason} (no CUDA to ask here)")
            spec = EdgeSpec(
                kind=kind,
                name=f"{prefix}-edge{first + k}",
                slots=widths.inflight,
                max_tokens=widths.max_tokens,
                hidden=int(source.config.hidden_size),
                dtype=view.model.dtype,
                producer=view.stages[k].device,
                consumer=view.stages[k + 1].device,
            )
            if kind in SHARED_MEMORY_KINDS:
                layout.segments(hosts[k]).edges.append(spec)
            elif kind != "tcp":
                layout.ipc_edges[spec.name] = (first + k, first + k + 1)
            log.info("edge", producer=first + k, kind=choice.kind, why=choice.reason)
            edges.append(spec)
        views = {pool: pool_view(plan, view, pool) for pool in (*MOVABLE_POOLS, "")} if ring.movable else {}
        layout.places += [StagePlace(ring.pool, view, first, edges, ring.name, views=views) for _ in view.stages]


def _shards(source: ModelSource, prefix: str, layout: Layout, placement: Placement) -> None:
    """Each expert shard's dispatch slot, sized from its pool's widths."""
    moe = source.moe
    for index, place in enumerate(layout.places):
        stage = place.plan.stages[index - place.first]
        for spec in stage.experts:
            if moe is None:  # the plan check refuses shards on a dense model first
                raise LayoutError(f"stage {index} has expert shards, but the model has no experts")
            number = len(layout.shards)
            slot = DispatchSlot(
                name=f"{prefix}-experts{number}",
                max_rows=max(v.batch.max_tokens for v in [place.plan, *place.views.values()]),
                hidden=moe.hidden,
                top_k=moe.top_k,
                dtype=place.plan.model.dtype,
                kind=dispatch_kind(stage.device, spec.device, placement.shards[number] == placement.stages[index]),
                stage_device=stage.device,
                shard_device=spec.device,
            )
            if slot.kind != "tcp":  # between hosts each side keeps its own copy
                layout.segments(placement.shards[number]).slots.append(slot)
            wiring = ShardWiring(number=number, stage=index, layers=stage.layers, spec=spec, slot=slot)
            layout.shards.append(wiring)
            place.shards.append(wiring)


def _kv_segments(plan: Plan, source: ModelSource, prefix: str, layout: Layout, placement: Placement) -> HandoffWiring:
    """The caches of every instance that may serve prefill (a prefill instance's, or with
    [planner] a movable one's), in shared memory the decode stages copy from."""
    rings = plan.rings()
    prefill = [ring for ring in rings if ring.pool == "prefill" or ring.movable]
    segments = {}
    for ring in prefill:
        view = ring.plan
        for k, stage in enumerate(view.stages, start=ring.first):
            segment = KvSegment(
                name=f"{prefix}-kv{k}",
                layers=stage.layers,
                num_blocks=view.kv.num_blocks,
                block_size=view.kv.block_size,
                kv_heads=source.kv_heads,
                head_dim=source.head_dim,
                dtype=view.model.dtype,
            )
            layout.segments(placement.stages[k]).kv.append(segment)
            segments[k] = segment
    return HandoffWiring(
        segments=segments,
        layers=[stage.layers for ring in rings for stage in ring.plan.stages],
        lease_s=plan.handoff.lease_s,
        hosts=[host or "" for host in placement.stages] if placement.spans_hosts else [],
        prefill_heads=[ring.first for ring in prefill],
        decode_heads=[ring.first for ring in rings if ring.pool == "decode" or ring.movable],
    )
