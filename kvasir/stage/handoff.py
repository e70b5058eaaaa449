"""KV hand-off between the pools of a disaggregated plan, stage to stage.

A prefill stage that has run a request's last prompt chunk announces where that
request's K/V for its layers sits in its cache (a shared-memory segment) to every
decode stage holding any of those layers (``HandoffSender``). A decode stage copies
its layers out of the prefill segments into the blocks the decode head placed it in,
re-slicing when the pools split the layers differently, and tells the decode head it
holds them (``KvReceiver``). Nothing goes through the bridge and every decode stage
copies in parallel. The prefill pool keeps the blocks until the decode head confirms.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import cast

from kvasir.errors import BatchError
from kvasir.model.kv_cache import PagedKVCache, flat_slots
from kvasir.ring.tcp_slots import EdgeError
from kvasir.stage.kv_remote import Assembly, KvInbox, KvStream, assemble, check_complete
from kvasir.stage.kv_segment import KvSegmentMap
from kvasir.transport.channels import PullChannel, PushChannel
from kvasir.wire.batch import BatchDescriptor
from kvasir.wire.control import HandoffWiring
from kvasir.wire.head import KvHeld
from kvasir.wire.kv import KvChunk, KvReady, Placement
from kvasir.wire.stats import HandoffCounters

DROPPED_KEPT = 65536  # ids of dropped requests a decode stage remembers (their late announcements are ignored)


def overlap(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


class DecodeRoutes:
    """Which decode instance each request of a prefill instance goes on to (its head's
    global index), learned from the descriptors' new requests and forgotten once handed
    on or released."""

    def __init__(self, heads: list[int]) -> None:
        self.heads = heads
        self._by_request: dict[int, int] = {}

    def learn(self, descriptor: BatchDescriptor) -> None:
        for new in descriptor.new_requests:
            head = new.decode_head
            if head == -1 and len(self.heads) == 1:
                head = self.heads[0]
            if head not in self.heads:
                raise BatchError(f"request {new.request_id} goes on to stage {head}, which is no decode head")
            self._by_request[new.request_id] = head
        for rid in descriptor.release:
            self._by_request.pop(rid, None)

    def take(self, rid: int) -> int:
        """The request's decode head (it is handed on now)."""
        head = self._by_request.pop(rid, None)
        if head is None:
            raise BatchError(f"request {rid} is handed on, but no descriptor said where to")
        return head


class NoHandoff:
    """A stage of a colocated plan: nothing to hand over (and the defaults of the others)."""

    sockets: list = []

    def receive(self) -> float:
        return 0.0

    def counters(self) -> HandoffCounters | None:
        return None

    def after(self, descriptor: BatchDescriptor) -> None:
        pass

    def close(self) -> None:
        pass


class HandoffSender(NoHandoff):
    """A prefill stage: after a request's last prompt chunk, announce its KV to the decode
    stages that hold the same layers."""

    def __init__(
        self,
        index: int,
        layers: tuple[int, int],
        cache: PagedKVCache,
        targets: dict[int, list[PushChannel]],
        streams: dict[int, list[KvStream]] | None = None,
    ) -> None:
        """Per decode instance (by its head's index): ``targets``, its stages on this host
        sharing layers with this one (they copy from this stage's segment); ``streams``,
        those on other hosts (the K/V goes to them, kvasir/stage/kv_remote.py)."""
        self.index = index
        self.layers = layers
        self.cache = cache
        self.targets = targets
        self.streams = streams or {}
        self.routes = DecodeRoutes(sorted({*targets, *self.streams}))
        self.sent_bytes = 0  # K/V streamed to other hosts

    def after(self, descriptor: BatchDescriptor) -> None:
        self.routes.learn(descriptor)
        for row in descriptor.rows:
            if row.emit:  # in the prefill pool, the row that ends the prompt
                table = tuple(self.cache.table(row.request_id))
                ready = KvReady(
                    row.request_id, self.index, self.layers, table, row.start + row.num_tokens, time.monotonic_ns()
                )
                head = self.routes.take(row.request_id)
                for target in self.targets.get(head, ()):
                    target.send(ready)
                for stream in self.streams.get(head, ()):
                    self.sent_bytes += stream.send(ready)


class KvReceiver(NoHandoff):
    """A decode stage: collect each request's announced parts and its placement, copy
    once both are complete, confirm to the decode head."""

    def __init__(
        self,
        index: int,
        layers: tuple[int, int],
        cache: PagedKVCache,
        wiring: HandoffWiring,
        inbox: PullChannel | KvInbox,
        head: PushChannel,
        *,
        expiry_s: float = 60.0,
    ) -> None:
        """``expiry_s``: a request's K/V streamed from another host and still partial this
        long after its first chunk is given up (handoff.lease_s: by then its prefill stage
        freed it and the request failed)."""
        self.index = index
        self.layers = layers
        self.cache = cache
        self.inbox = inbox
        self.head = head
        here = wiring.hosts[index] if wiring.hosts else ""
        mine = wiring.head_of(index)
        sharing = [  # other instances' stages that may hand this one KV
            (source, segment)
            for source, segment in sorted(wiring.segments.items())
            if overlap(segment.layers, layers) and wiring.head_of(source) != mine
        ]
        self.sources = {  # prefill stages on this host: their caches, mapped
            source: KvSegmentMap(segment, create=False)
            for source, segment in sharing
            if not wiring.hosts or wiring.hosts[source] == here
        }
        self.remote = {  # on other hosts: the layers they stream
            source: cast(tuple[int, int], overlap(segment.layers, layers))
            for source, segment in sharing
            if source not in self.sources
        }
        self.expected = {  # per prefill instance (its head): its stages sharing layers with this one
            head: frozenset(source for source, _ in sharing if source in wiring.ring_of(head))
            for head in wiring.prefill_heads
            if head != mine
        }
        self.assembling: dict[int, dict[int, Assembly]] = {}  # request -> source -> its chunks so far
        self.expiry_s = expiry_s
        self.expired = 0  # partial hand-offs given up
        self.sockets = [inbox.socket]
        self.parts: dict[int, dict[int, KvReady]] = {}
        self.placed: dict[int, tuple[tuple[int, ...], frozenset[int]]] = {}  # blocks, the stages to copy from
        self.dropped: OrderedDict[int, None] = OrderedDict()
        self.nbytes = 0  # KV bytes received
        self.copy_s = 0.0  # seconds spent copying them

    def counters(self) -> HandoffCounters | None:
        return HandoffCounters(bytes=self.nbytes, copy_s=self.copy_s)

    def receive(self) -> float:
        """Take announcements and placements; copy what is complete. Seconds spent copying."""
        started = time.perf_counter()
        self._expire(time.monotonic())
        touched = set()
        for message in self.inbox.drain():
            match message:
                case (KvChunk() as chunk, keys, values):
                    self._chunk(chunk, keys, values)
                case KvReady(request_id=rid, source=source) if source in self.remote:
                    if rid not in self.dropped:
                        check_complete(self.assembling.get(rid, {}).get(source), message)
                        self.parts.setdefault(rid, {})[source] = message
                    touched.add(rid)
                case KvReady(request_id=rid, source=source):
                    if source not in self.sources:
                        raise BatchError(
                            f"KV of request {rid} announced by stage {source}, which shares no layers with stage {self.index}"
                        )
                    if rid not in self.dropped:  # a drop may overtake the announcement (another socket)
                        self.parts.setdefault(rid, {})[source] = message
                    touched.add(rid)
                case Placement(request_id=rid, blocks=blocks, prefill_head=head) if blocks:
                    if head not in self.expected:
                        raise BatchError(f"request {rid} placed from stage {head}, which is no prefill instance's head")
                    self.placed[rid] = blocks, self.expected[head]
                    touched.add(rid)
                case Placement(request_id=rid):
                    self._forget(rid)
        copied = [rid for rid in touched if self._try(rid)]
        spent = time.perf_counter() - started if copied else 0.0
        self.copy_s += spent
        return spent

    def _try(self, rid: int) -> bool:
        parts = self.parts.get(rid)
        placed = self.placed.get(rid)
        if placed is None or parts is None or not placed[1] <= parts.keys():
            return False
        blocks, sources = self.placed.pop(rid)
        started = time.monotonic_ns()
        table = self.cache.extend(rid, blocks)
        nbytes = sum(self._copy(rid, part, table) for source, part in self.parts.pop(rid).items() if source in sources)
        self.nbytes += nbytes
        held = time.monotonic_ns()
        self.head.send(KvHeld(rid, self.index, nbytes, held - started, held))
        return True

    def _chunk(self, chunk: KvChunk, keys, values) -> None:
        if self.remote.get(chunk.source) != chunk.layers:
            raise EdgeError(
                f"KV chunk of request {chunk.request_id}: stage {chunk.source} does not stream {chunk.layers} here"
            )
        if chunk.request_id not in self.dropped:
            assemble(self.assembling.setdefault(chunk.request_id, {}), chunk, keys, values)

    def _copy(self, rid: int, part: KvReady, table: list[int]) -> int:
        """Copy one prefill stage's share of a request's K/V into this stage's blocks."""
        if part.source in self.remote:
            return self._copy_streamed(rid, part, table)
        source = self.sources[part.source]
        span = overlap(part.layers, self.layers)
        if span is None:
            raise BatchError(
                f"request {rid}: stage {part.source}'s layers {part.layers} miss this stage's {self.layers}"
            )
        lo, hi = span
        first = source.spec.layers[0]
        src = flat_slots(rid, part.blocks, source.spec.block_size, 0, part.num_tokens)
        if src.numel() and int(src.max()) >= source.keys.shape[1]:
            raise BatchError(f"request {rid}: prefill blocks {part.blocks} outside stage {part.source}'s cache")
        dst = self.cache.slots(rid, table, 0, part.num_tokens)
        mine = slice(lo - self.layers[0], hi - self.layers[0])
        theirs = slice(lo - first, hi - first)
        keys, values = self.cache.keys, self.cache.values
        keys[mine, dst] = source.keys[theirs, src].to(keys.device)
        values[mine, dst] = source.values[theirs, src].to(values.device)
        return PagedKVCache.bytes_needed(hi - lo, part.num_tokens, 1, keys.shape[2], keys.shape[3], keys.dtype)

    def _copy_streamed(self, rid: int, part: KvReady, table: list[int]) -> int:
        """Copy the K/V a prefill stage on another host streamed here into this stage's blocks."""
        lo, hi = self.remote[part.source]
        assembly = self.assembling[rid].pop(part.source)
        if not self.assembling[rid]:
            del self.assembling[rid]
        dst = self.cache.slots(rid, table, 0, part.num_tokens)
        mine = slice(lo - self.layers[0], hi - self.layers[0])
        keys, values = self.cache.keys, self.cache.values
        keys[mine, dst] = assembly.keys.to(keys.device)
        values[mine, dst] = assembly.values.to(values.device)
        return PagedKVCache.bytes_needed(hi - lo, part.num_tokens, 1, keys.shape[2], keys.shape[3], keys.dtype)

    def _expire(self, now: float) -> None:
        """Give up streamed hand-offs still partial past ``expiry_s``: later chunks of them
        are ignored, as for a dropped request."""
        for rid, sources in list(self.assembling.items()):
            if any(now - assembly.started > self.expiry_s for assembly in sources.values()):
                del self.assembling[rid]
                self.parts.pop(rid, None)
                self.expired += 1
                self._dropped(rid)

    def _dropped(self, rid: int) -> None:
        self.dropped[rid] = None
        if len(self.dropped) > DROPPED_KEPT:
            self.dropped.popitem(last=False)

    def _forget(self, rid: int) -> None:
        """A dropped request: its parts, placement and table go; announcements still on
        their way are ignored when they come (request ids are never reused)."""
        self.parts.pop(rid, None)
        self.assembling.pop(rid, None)
        self.placed.pop(rid, None)
        self.cache.release((rid,))
        self._dropped(rid)

    def close(self) -> None:
        for source in self.sources.values():
            source.close()
