"""The KV pool's figures in ``kvasir stats`` (kvasir/kvpool/): the bridge's index, and
the stages' reads, writes and storage faults summed."""

from __future__ import annotations

import msgspec

from kvasir.units import format_bytes, gib_per_s
from kvasir.wire.stats import PoolFault, StageStats


class PoolSource(msgspec.Struct, frozen=True, kw_only=True):
    """What the stages read back from one place: "host memory", "disk", or "host NAME"
    (another host's pool)."""

    source: str
    slices: int
    bytes: int
    gib_s: float


class StageTier(msgspec.Struct, frozen=True, kw_only=True):
    """A stage's tier of the pool that does not serve now."""

    stage: int  # its global index
    tier: str  # "host" (memory) or "disk"
    path: str
    state: str  # "paused" (after faults, tried again later) or "refused" (at start)
    reason: str


class KvPoolStats(msgspec.Struct, frozen=True, kw_only=True):
    """The KV pool (kvasir/kvpool/): the bridge's index, and the stages' tiers since they started."""

    indexed_blocks: int  # block keys the bridge's index knows a slice of
    pooled_tokens: int  # prompt tokens the heads read back from the pool instead of computing them
    spilled: int  # stage slices of evicted blocks queued to be written down
    dropped: int  # of those offered, dropped: a stage's write queue was full
    loaded: int  # stage slices read back
    unusable: int  # stage slices corrupt or made with something else (removed; recomputed)
    load_bytes: int
    load_gib_s: float  # load_bytes over the stages' time spent loading
    missing: int = 0  # stage slices asked for and not found (recomputed)
    remote_bytes: int = 0  # of load_bytes, read from other hosts' pools
    remote_gib_s: float = 0.0  # over the time those reads took
    sources: list[PoolSource] = []  # by tier and remote host
    faults: list[PoolFault] = []  # storage faults, every stage's summed by tier, operation and reason
    tiers: list[StageTier] = []  # the stages' tiers that do not serve now (paused or refused)

    def faults_line(self) -> str | None:
        """Storage faults and the tiers off, for ``kvasir stats``; None while there are none."""
        counts = [f"{f.tier} {f.op} {f.reason} {f.count}" for f in self.faults]
        down = [f"stage {t.stage}'s {t.tier} tier {t.state} ({t.path}: {t.reason})" for t in self.tiers]
        parts = ([", ".join(counts)] if counts else []) + down
        return "kv pool faults: " + "; ".join(parts) if parts else None

    def sources_line(self) -> str | None:
        """What was read back from where, for ``kvasir stats``; None before any read."""
        parts = [f"{s.source} {s.slices} slices, {format_bytes(s.bytes)} at {s.gib_s:.2f} GiB/s" for s in self.sources]
        return "kv pool read from: " + "; ".join(parts) if parts else None

    host_bytes: int  # bytes the slices take in the host memory tiers now
    disk_bytes: int  # and in the disk tiers

    def describe(self) -> str:
        """One line for ``kvasir stats``."""
        return (
            f"kv pool: {self.indexed_blocks} blocks indexed, {self.pooled_tokens} prompt tokens read back "
            f"({self.loaded} slices, {self.load_gib_s:.2f} GiB/s, {format_bytes(self.remote_bytes)} from other hosts "
            f"at {self.remote_gib_s:.2f} GiB/s; {self.missing} missing, {self.unusable} unusable); {self.spilled} "
            f"written down, {self.dropped} dropped; {format_bytes(self.host_bytes)} in host memory, "
            f"{format_bytes(self.disk_bytes)} on disk"
        )

    @classmethod
    def of(cls, indexed: int, stages: list[StageStats], host_of: dict[int, str] | None = None) -> KvPoolStats:
        """Summed over the stages' reports (``host_of``: each stage's host, by global index)."""
        pools = [s.kv_pool for s in stages if s.kv_pool is not None]
        nbytes, seconds = sum(p.load_bytes for p in pools), sum(p.load_s for p in pools)
        return cls(
            indexed_blocks=indexed,
            pooled_tokens=sum(s.prefix.pooled_tokens for s in stages if s.prefix is not None),
            spilled=sum(p.spilled for p in pools),
            dropped=sum(p.dropped for p in pools),
            loaded=sum(p.loaded for p in pools),
            unusable=sum(p.unusable for p in pools),
            load_bytes=nbytes,
            load_gib_s=gib_per_s(nbytes, seconds),
            missing=sum(p.missing for p in pools),
            remote_bytes=(remote := sum(p.remote_bytes for p in pools)),
            remote_gib_s=gib_per_s(remote, sum(p.remote_s for p in pools)),
            sources=_sources(pools, host_of or {}),
            faults=_faults(pools),
            tiers=[
                StageTier(stage=s.index, tier=t.tier, path=t.path, state=t.state, reason=t.reason)
                for s in stages
                if s.kv_pool is not None
                for t in s.kv_pool.tiers
            ],
            host_bytes=sum(p.host_bytes for p in pools),
            disk_bytes=sum(p.disk_bytes for p in pools),
        )


def _faults(pools: list) -> list[PoolFault]:
    """The stages' storage faults summed by tier, operation and reason."""
    sums: dict[tuple[str, str, str], int] = {}
    for pool in pools:
        for fault in pool.faults:
            kind = (fault.tier, fault.op, fault.reason)
            sums[kind] = sums.get(kind, 0) + fault.count
    return [PoolFault(tier, op, reason, count) for (tier, op, reason), count in sorted(sums.items())]  # type: ignore[arg-type]


def _sources(pools: list, host_of: dict[int, str]) -> list[PoolSource]:
    """The stages' reads summed by where they came from."""
    names = {"host": "host memory", "disk": "disk"}
    sums: dict[str, tuple[int, int, float]] = {}
    for pool in pools:
        for read in pool.reads:
            source = names.get(read.tier) or f"host {host_of.get(read.peer) or '?'}"
            slices, nbytes, seconds = sums.get(source, (0, 0, 0.0))
            sums[source] = (slices + read.slices, nbytes + read.bytes, seconds + read.seconds)
    return [PoolSource(source=k, slices=n, bytes=b, gib_s=gib_per_s(b, t)) for k, (n, b, t) in sums.items()]
