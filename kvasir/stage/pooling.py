"""A stage's part in the KV pool (docs/architecture.md, The KV pool), and its head's wait
for a request's pool blocks.

Every stage, before a descriptor's rows: notes which blocks the head's cache registered
(a clean stop writes those down), writes down its slices of the blocks the head's cache
evicted (``spill``: copied out now, written by the pool's writer thread), then
reads back its slices of the blocks the head asks for (``load``), in order and up to the
first it cannot, and tells the head which it read (``PoolLoaded``: to its own head by a
call on the head stage, by a message from the others). After each loop turn it sends
the bridge its tiers' changes (``PoolEvents``), which feed the conductor's index.

The head (``LoadWaits``) holds a loading request until every stage of its ring has
answered, then counts as cached the blocks every stage read; past ``timeout_s`` it
gives up waiting and the request computes them (a stage's late load is harmless: the
request's rows come after it round the ring and overwrite it).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from kvasir.kvpool.health import TierHealth
from kvasir.kvpool.index import Tier
from kvasir.kvpool.slices import SliceMeta
from kvasir.kvpool.stage_side import StagePool
from kvasir.model.fingerprint import model_identity
from kvasir.model.source import ModelSource
from kvasir.stage.pool_peers import PeerFetcher, SliceServer
from kvasir.transport.channels import PushChannel
from kvasir.units import MIB
from kvasir.wire.batch import BatchDescriptor, PoolLoad
from kvasir.wire.bridge import PoolEvents
from kvasir.wire.head import PoolLoaded
from kvasir.wire.stats import PoolCounters, PoolFault, PoolReads, PoolTierState

MAX_QUEUED_BYTES = 256 * MIB  # a stage's slices copied out and not yet written
SLOWER: tuple[Tier, ...] = ("host", "disk", "remote")  # a block read from several tiers counts at the slowest


class NoPool:
    """A plan without [kv_pool]: nothing is written down or read back."""

    def before(self, descriptor: BatchDescriptor) -> float:
        return 0.0

    def events(self) -> None:
        pass

    def counters(self) -> PoolCounters | None:
        return None

    def close(self) -> None:
        pass


@dataclass
class Peers:
    """A stage of a plan across hosts: its server of slices to other hosts, its fetcher
    from them, and how long a fetch may take."""

    server: SliceServer
    fetcher: PeerFetcher
    fetch_s: float

    def close(self) -> None:
        self.server.close()
        self.fetcher.close()


class PoolRole:
    """One stage's spills and loads, run on its loop before each descriptor's rows."""

    def __init__(
        self,
        pool: StagePool,
        index: int,
        pid: int,
        loaded: Callable[[PoolLoaded], None],
        bridge: PushChannel,
        log,
        *,
        peers: Peers | None = None,
    ) -> None:
        self.pool = pool
        self.index = index
        self.pid = pid
        self.loaded = loaded  # to the ring's head
        self.bridge = bridge
        self.log = log
        self.peers = peers
        self.load_s = 0.0
        self.reads: dict[tuple[Tier, int], tuple[int, int, float]] = {}  # (tier, peer) -> slices, bytes, seconds

    def before(self, descriptor: BatchDescriptor) -> float:
        """Spill, then load, what the descriptor names; the seconds it took."""
        started = time.monotonic()
        blocks = self.pool.cache.num_blocks
        registered = [(block, key) for block, key in descriptor.registered if 0 <= block < blocks]
        spills = [(block, key) for block, key in descriptor.spill if 0 <= block < blocks]
        if len(spills) + len(registered) != len(descriptor.spill) + len(descriptor.registered):
            self.log.warning(
                "the KV pool's news name blocks out of range; those are skipped", batch=descriptor.batch_id
            )
        self.pool.registered(registered)
        self.pool.spill(spills)
        loading = time.monotonic()
        for load in descriptor.load:
            valid = len(load.blocks) == len(load.keys) and all(0 <= block < blocks for block in load.blocks)
            tiers = self._read(load) if valid else []
            self.loaded(PoolLoaded(load.request_id, self.index, tuple(tiers)))
        ended = time.monotonic()
        self.load_s += ended - loading
        return ended - started

    def _read(self, load: PoolLoad) -> list[Tier]:
        """The tier each block was read from, from the first, up to the first it could not:
        this host's tiers, then the other host the bridge named for this stage."""
        tiers: list[Tier] = []
        size = self.pool.template.payload_bytes
        for block, key in zip(load.blocks, load.keys, strict=True):
            started = time.monotonic()
            tier = self.pool.load(block, key)
            if tier is None:
                break
            self._count(tier, -1, size, time.monotonic() - started)
            tiers.append(tier)
        peer = dict(load.peers).get(self.index)
        if peer is None or self.peers is None or len(tiers) == len(load.keys):
            return tiers
        start, started = len(tiers), time.monotonic()
        fetched = self.peers.fetcher.fetch(peer, list(load.keys[start:]), started + self.peers.fetch_s)
        for block, key, data in zip(load.blocks[start:], load.keys[start:], fetched):
            if not self.pool.place(block, key, data):
                break
            tiers.append("remote")
        fetched.close()
        if len(tiers) > start:
            self._count("remote", peer, (len(tiers) - start) * size, time.monotonic() - started, len(tiers) - start)
        return tiers

    def _count(self, tier: Tier, peer: int, nbytes: int, seconds: float, slices: int = 1) -> None:
        count, total, spent = self.reads.get((tier, peer), (0, 0, 0.0))
        self.reads[(tier, peer)] = (count + slices, total + nbytes, spent + seconds)

    def events(self) -> None:
        if self.peers is not None:
            self.peers.server.check()
        for changed in self.pool.take_events():
            message = PoolEvents(
                self.index, self.pid, changed.tier, tuple(changed.stored), tuple(changed.removed), changed.reset
            )
            self.bridge.send(message)

    def counters(self) -> PoolCounters:
        c, tiers = self.pool.counters, self.pool.tiers
        return PoolCounters(
            spilled=c.spilled,
            dropped=c.dropped,
            loaded=c.loaded,
            unusable=c.unusable,
            missing=c.missing,
            load_bytes=c.loaded * self.pool.template.payload_bytes,
            load_s=self.load_s,
            remote_bytes=self.peers.fetcher.fetched_bytes if self.peers is not None else 0,
            remote_s=self.peers.fetcher.fetch_s if self.peers is not None else 0.0,
            reads=tuple(
                PoolReads(tier, slices, nbytes, seconds, peer)
                for (tier, peer), (slices, nbytes, seconds) in sorted(self.reads.items())
            ),
            host_bytes=tiers["host"].bytes if "host" in tiers else 0,
            disk_bytes=tiers["disk"].bytes if "disk" in tiers else 0,
            faults=tuple(fault for health in self.pool.healths for fault in _faults(health)),
            tiers=tuple(
                PoolTierState(h.tier, h.path, h.state, h.reason) for h in self.pool.healths if h.state != "serving"
            ),
        )

    def close(self) -> None:
        if self.peers is not None:
            self.peers.close()
        self.pool.close()


def _faults(health: TierHealth) -> list[PoolFault]:
    return [PoolFault(health.tier, op, reason, count) for op, reason, count in health.counts()]  # type: ignore[arg-type]


def slice_template(source: ModelSource, dtype: str, layers: tuple[int, int], block_size: int) -> SliceMeta:
    """What a stage's slices are made with (less each block's key)."""
    return SliceMeta(
        model=model_identity(source.weights_dir, dtype),
        layers=layers,
        block_size=block_size,
        kv_heads=source.kv_heads,
        head_dim=source.head_dim,
        dtype=dtype,
        key=b"",
    )


class LoadWaits:
    """A head's loading requests: which stages have answered, until when it waits."""

    def __init__(self, stages: range, timeout_s: float) -> None:
        self.stages = stages  # the ring's global stage indexes
        self.timeout_s = timeout_s
        self._waiting: dict[int, tuple[float, dict[int, tuple[Tier, ...]]]] = {}  # request -> deadline, answers

    def __len__(self) -> int:
        return len(self._waiting)

    def expect(self, request_id: int, now: float) -> None:
        self._waiting[request_id] = (now + self.timeout_s, {})

    def answer(self, message: PoolLoaded) -> list[Tier] | None:
        """Note one stage's answer; once every stage answered, the tier of each block all
        of them read (the slowest stage's), and the request is no longer waited for."""
        entry = self._waiting.get(message.request_id)
        if entry is None or message.stage not in self.stages:
            return None
        answers = entry[1]
        answers[message.stage] = message.tiers
        if len(answers) < len(self.stages):
            return None
        del self._waiting[message.request_id]
        count = min(len(tiers) for tiers in answers.values())
        return [max((t[i] for t in answers.values()), key=SLOWER.index) for i in range(count)]

    def expired(self, now: float) -> list[int]:
        """The requests waited for past their deadline (no longer waited for)."""
        late = [rid for rid, (deadline, _) in self._waiting.items() if deadline <= now]
        for rid in late:
            del self._waiting[rid]
        return late
