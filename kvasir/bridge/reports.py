"""The workers' latest reports as the bridge keeps them: each stage's and shard's figures,
each stage's recent batch spans, and what the heads tell the conductor (their prefix
blocks, a decode head's KV in use). Reports from a process that no longer serves its
instance are stale and dropped (kvasir/bridge/heads.py says which are current)."""

from __future__ import annotations

from collections import deque

import msgspec

from kvasir.bridge.heads import Heads
from kvasir.wire.bridge import PoolEvents, PrefixEvents
from kvasir.wire.stats import BatchSpan, ShardStats, StageStats

TIMELINE_SPANS = 4096  # recent batch spans kept per stage for timelines (kvasir bench --plot)


class Reports:
    def __init__(self, heads: Heads) -> None:
        self.heads = heads
        self.stages: dict[int, StageStats] = {}  # by global index
        self.shards: dict[int, ShardStats] = {}  # by number
        self.timelines: dict[int, deque[BatchSpan]] = {}

    def note(self, report: StageStats | ShardStats | PrefixEvents | PoolEvents) -> None:
        heads = self.heads
        match report:
            case PoolEvents(stage=index, pid=pid) if heads.pool is not None:
                heads.pool.note(report, heads.current(index, pid))
            case PrefixEvents(head=index, pid=pid) if heads.current(index, pid):
                heads.conductor.events(heads.instance_of[index], report.stored, report.removed, report.reset)
            case StageStats(index=index, pid=pid) if heads.current(index, pid):
                if heads.pool is not None:
                    heads.pool.measured(report)
                if report.pool == "decode" and report.head is not None:
                    heads.conductor.kv_used(report.instance, report.kv.blocks)
                self.timelines.setdefault(index, deque(maxlen=TIMELINE_SPANS)).extend(report.spans)
                self.stages[index] = msgspec.structs.replace(report, spans=())
            case ShardStats(stage=stage, pid=pid) if heads.current(stage, pid):
                self.shards[report.number] = report

    def forget(self, names: list[str]) -> None:
        """The figures of failed instances' workers (their new processes report afresh)."""
        of = self.heads.instance_of
        for index in [k for k in self.stages if of.get(k) in names]:
            del self.stages[index]
            self.timelines.pop(index, None)
        for number in [n for n, s in self.shards.items() if of.get(s.stage) in names]:
            del self.shards[number]
