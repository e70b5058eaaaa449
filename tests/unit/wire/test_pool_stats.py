"""``kvasir stats``' KV pool figures (kvasir/wire/pool_stats.py KvPoolStats): the stages' reads
summed by where they came from, other hosts named."""

from __future__ import annotations

from kvasir.units import GIB
from kvasir.wire.pool_stats import KvPoolStats
from kvasir.wire.stats import PoolCounters, PoolFault, PoolReads, PoolTierState, StageStats


def stage(index: int, *reads: PoolReads) -> StageStats:
    pool = PoolCounters(loaded=sum(r.slices for r in reads), reads=reads)
    return StageStats(index, (0, 1), 100 + index, 1.0, 0.5, 0.5, 0.0, 1, 1, 1, kv_pool=pool)


def test_reads_are_summed_by_tier_and_by_remote_host():
    stages = [
        stage(0, PoolReads("host", 2, GIB, 1.0), PoolReads("remote", 1, GIB, 4.0, peer=3)),
        stage(1, PoolReads("host", 2, GIB, 1.0), PoolReads("disk", 1, GIB // 2, 1.0)),
    ]
    pool = KvPoolStats.of(5, stages, {3: "b"})
    assert [(s.source, s.slices, s.bytes, s.gib_s) for s in pool.sources] == [
        ("host memory", 4, 2 * GIB, 1.0),
        ("host b", 1, GIB, 0.25),
        ("disk", 1, GIB // 2, 0.5),
    ]
    line = pool.sources_line()
    assert line is not None and line.startswith("kv pool read from: host memory 4 slices, 2.0 GiB at 1.00 GiB/s")
    assert KvPoolStats.of(0, []).sources_line() is None


def test_storage_faults_are_summed_and_the_tiers_down_named():
    full = PoolFault("disk", "write", "ENOSPC", 3)
    refused = PoolTierState("host", "/dev/shm/x-kvpool", "refused", "open owner: owned by uid 65534")
    stages = [
        StageStats(0, (0, 1), 100, 1.0, 0.5, 0.5, 0.0, 1, 1, 1, kv_pool=PoolCounters(faults=(full,))),
        StageStats(1, (1, 2), 101, 1.0, 0.5, 0.5, 0.0, 1, 1, 1, kv_pool=PoolCounters(faults=(full,), tiers=(refused,))),
    ]
    pool = KvPoolStats.of(0, stages)
    assert pool.faults == [PoolFault("disk", "write", "ENOSPC", 6)]
    assert pool.faults_line() == (
        "kv pool faults: disk write ENOSPC 6; stage 1's host tier refused "
        "(/dev/shm/x-kvpool: open owner: owned by uid 65534)"
    )
    assert KvPoolStats.of(0, [stage(0)]).faults_line() is None
