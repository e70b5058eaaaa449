"""The bridge's answer to a stats query, from its own counters and the stages' reports."""

from __future__ import annotations

import time
from typing import Any

from kvasir.wire.client import DaemonStats, PrefixCacheStats
from kvasir.wire.pool_stats import KvPoolStats
from kvasir.wire.stats import DraftCounters


def daemon_stats(bridge: Any, timeline: bool = False) -> DaemonStats:
    """What ``kvasir stats`` shows: the bridge's (kvasir/bridge/server.py) own figures and
    the stages' latest reports."""
    reports = bridge.reports
    order = sorted(reports.stages)
    stages = [reports.stages[k] for k in order]
    return DaemonStats(
        uptime_s=time.monotonic() - bridge.started,
        requests=bridge.accepted,
        in_flight=len(bridge.requests),
        tokens_out=bridge.metrics.generation_tokens,
        waiting_limit=bridge.max_waiting,
        vocab_size=bridge.vocab_size,
        max_seq_len=bridge.max_seq_len,
        stages=stages,
        shards=[reports.shards[k] for k in sorted(reports.shards)],
        timeline=[list(reports.timelines.get(k, ())) for k in order] if timeline else [],
        state="draining" if bridge.draining else "restarting" if bridge.restarting is not None else "serving",
        restarts=bridge.heads.total_restarts(),
        last_failure=bridge.last_failure,
        last_failure_age_s=time.monotonic() - bridge.last_failure_at if bridge.last_failure is not None else None,
        handoff=bridge.handoffs.summary(),
        client_bytes_waiting=bridge.outbox.waiting_bytes,
        clients_lost=bridge.clients_lost,
        malformed=bridge.malformed,
        hosts_missing=bridge.hosts_missing,
        metrics=bridge.metrics.snapshot(),
        prefix_cache=PrefixCacheStats.of(stages) if stages else None,
        instances=bridge.moves.annotate(bridge.heads.report(reports.stages), time.monotonic()),
        kv_pool=_kv_pool(bridge.heads.pool, stages),
        drafts=_drafts(stages),
        planner=bridge.moves.auto.stats(time.monotonic()) if bridge.moves.auto is not None else None,
    )


def _drafts(stages) -> DraftCounters | None:
    """Speculative decoding's counts (a plan with [speculative]), every instance's together."""
    counts = [s.drafts for s in stages if s.drafts is not None]
    return sum(counts[1:], counts[0]) if counts else None


def _kv_pool(pool, stages) -> KvPoolStats | None:
    """The KV pool's figures (a plan with [kv_pool]): the bridge's index, the stages' reads."""
    if pool is None:
        return None
    return KvPoolStats.of(len(pool.index), stages, {index: host for index, (host, _) in pool.slot_of.items()})
