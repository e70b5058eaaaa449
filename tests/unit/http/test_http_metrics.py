"""/metrics from a stats snapshot, read back with prometheus_client's parser."""

from __future__ import annotations

import json
import re
from pathlib import Path

import msgspec
from prometheus_client.parser import text_string_to_metric_families

from kvasir.bridge.metrics import Metrics
from kvasir.http.metrics import render
from kvasir.wire.client import DaemonStats, HandoffSummary, Timings
from kvasir.wire.stats import HeadQueue, KvUse, ShardStats, StageStats


def stage(index: int, waiting: int = 0, pool: str = "") -> StageStats:
    return StageStats(
        index,
        (index, index + 1),
        100 + index,
        10.0,
        6.0,
        3.0,
        1.0,
        5,
        5,
        50,
        kv=KvUse(2, 7),
        head=HeadQueue(0, waiting) if index == 0 else None,
        pool=pool,
    )


def test_the_snapshot_reads_back_as_vllm_named_series():
    metrics = Metrics()
    metrics.accepted(12)
    for gap in (None, 20_000_000, 40_000_000):
        metrics.token(gap)
    metrics.finished("length", Timings(queued_s=0.01, first_token_s=0.2, per_token_s=0.03, total_s=0.26), 12, 3)
    metrics.ended_early("cancelled")
    shard = ShardStats(0, 1, (0, 4), 300, 10.0, 2.0, 8.0, 0.0, 3, 30, (10, 10, 5, 5))
    stats = DaemonStats(
        uptime_s=10.0,
        requests=3,
        in_flight=3,
        waiting_limit=10,
        vocab_size=100,
        max_seq_len=64,
        stages=[stage(0, waiting=1), stage(1)],
        shards=[shard],
        metrics=metrics.snapshot(),
        handoff=HandoffSummary(count=2, kv_bytes=4096, p50_s=0.1, p99_s=0.2, gibps=1.0, seconds=0.3),
    )
    families = {f.name: f for f in text_string_to_metric_families(render(stats, "m").decode())}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    model = (("model_name", "m"),)
    assert samples[("kvasir:num_requests_waiting", model)] == 1
    assert samples[("kvasir:num_requests_running", model)] == 2
    assert samples[("kvasir:prompt_tokens_total", model)] == 12
    assert samples[("kvasir:generation_tokens_total", model)] == 3
    assert samples[("kvasir:request_success_total", (("finished_reason", "length"), *model))] == 1
    assert samples[("kvasir:request_success_total", (("finished_reason", "abort"), *model))] == 1
    itl = families["kvasir:inter_token_latency_seconds"]
    assert itl.type == "histogram"
    assert samples[("kvasir:inter_token_latency_seconds_bucket", (("le", "0.025"), *model))] == 1
    assert samples[("kvasir:inter_token_latency_seconds_bucket", (("le", "+Inf"), *model))] == 2
    assert abs(samples[("kvasir:inter_token_latency_seconds_sum", model)] - 0.06) < 1e-9
    busy = {
        tuple(s.labels[k] for k in ("role", "stage", "shard")): s.value
        for s in families["kvasir:worker_busy_seconds"].samples
    }
    assert busy == {("stage", "0", ""): 6.0, ("stage", "1", ""): 6.0, ("shard", "1", "0"): 2.0}
    assert samples[("kvasir:handoff_bytes_total", model)] == 4096
    assert all(s.labels["model_name"] == "m" for f in families.values() for s in f.samples)


def test_a_fleets_series_carry_the_instance():
    from kvasir.wire.fleet import InstanceStats
    from kvasir.wire.stats import PrefixCounters

    stages = [msgspec.structs.replace(stage(k), instance="a" if k < 2 else "b") for k in range(4)]
    shard = ShardStats(0, 3, (0, 4), 300, 10.0, 2.0, 8.0, 0.0, 3, 30, (10, 10, 5, 5))
    instances = [
        InstanceStats(name="a", pool="", state="serving", stages=[0, 1], requests=2, routed=9, restarts=1,
                      prefix=PrefixCounters(queries=3, prompt_tokens=300, hit_tokens=240)),
        InstanceStats(name="b", pool="", state="restarting", stages=[2, 3], routed=4, moves=2),
        InstanceStats(name="c", pool="", state="parked", stages=[4, 5], hosts=["h"]),
    ]  # fmt: skip
    stats = DaemonStats(
        uptime_s=1.0,
        requests=13,
        in_flight=2,
        waiting_limit=10,
        vocab_size=100,
        max_seq_len=64,
        stages=stages,
        shards=[shard],
        instances=instances,
    )
    families = {f.name: f for f in text_string_to_metric_families(render(stats, "m").decode())}

    def by_instance(name: str) -> dict[str, float]:
        return {s.labels["instance"]: s.value for s in families[name].samples if not s.name.endswith("_created")}

    assert by_instance("kvasir:instance_serving") == {"a": 1.0, "b": 0.0, "c": 0.0}
    assert by_instance("kvasir:instance_parked") == {"a": 0.0, "b": 0.0, "c": 1.0}
    assert by_instance("kvasir:instance_routed") == {"a": 9.0, "b": 4.0, "c": 0.0}
    assert by_instance("kvasir:instance_restarts") == {"a": 1.0, "b": 0.0, "c": 0.0}
    assert by_instance("kvasir:instance_moves") == {"a": 0.0, "b": 2.0, "c": 0.0}
    assert by_instance("kvasir:instance_prefix_cache_hit_tokens") == {"a": 240.0, "b": 0.0, "c": 0.0}
    busy = {
        (s.labels["role"], s.labels["stage"]): s.labels["instance"]
        for s in families["kvasir:worker_busy_seconds"].samples
    }
    assert busy == {
        ("stage", "0"): "a",
        ("stage", "1"): "a",
        ("stage", "2"): "b",
        ("stage", "3"): "b",
        ("shard", "3"): "b",
    }


def one_request(**more) -> DaemonStats:
    """Two stages that served one request of 12 prompt and 2 output tokens (and ``more``)."""
    metrics = Metrics(max_seq_len=64)
    metrics.accepted(12)
    for gap in (None, 20_000_000):
        metrics.token(gap)
    metrics.finished("stop", Timings(queued_s=0.01, first_token_s=0.2, per_token_s=0.02, total_s=0.22), 12, 2)
    return DaemonStats(
        uptime_s=1.0,
        requests=1,
        in_flight=0,
        waiting_limit=10,
        vocab_size=100,
        max_seq_len=64,
        stages=[stage(0), stage(1)],
        metrics=metrics.snapshot(),
        **more,
    )


def test_the_vllm_prefix_and_the_series_its_dashboard_reads():
    """``[http] metrics_prefix = "vllm"``: vLLM's Grafana dashboard reads these names."""
    text = render(one_request(), "m", "vllm", {0: 20}).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert all(name.startswith("vllm:") for name in families)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    model = (("model_name", "m"),)
    assert samples[("vllm:kv_cache_usage_perc", model)] == 7 / 20  # the head holds 7 of its instance's 20 blocks
    assert samples[("vllm:time_per_output_token_seconds_count", model)] == 1
    assert samples[("vllm:request_prompt_tokens_bucket", (("le", "10.0"), *model))] == 0
    assert samples[("vllm:request_prompt_tokens_bucket", (("le", "20.0"), *model))] == 1
    assert samples[("vllm:request_generation_tokens_bucket", (("le", "2.0"), *model))] == 1
    bounds = [s.labels["le"] for s in families["vllm:request_prompt_tokens"].samples if s.name.endswith("_bucket")]
    assert bounds == ["1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "+Inf"]  # 1-2-5 up to max_seq_len


DASHBOARD = Path(__file__).parents[3] / "grafana" / "kvasir.json"


def test_the_grafana_dashboard_reads_only_series_that_exist():
    """grafana/kvasir.json: every series and label its queries name is one /metrics serves."""
    from kvasir.wire.fleet import InstanceStats
    from kvasir.wire.pool_stats import KvPoolStats, StageTier
    from kvasir.wire.stats import PoolFault

    stats = one_request(
        shards=[ShardStats(0, 1, (0, 4), 300, 10.0, 2.0, 8.0, 0.0, 3, 30, (10, 10, 5, 5))],
        instances=[InstanceStats(name="a", pool="", state="serving", stages=[0, 1])],
        handoff=HandoffSummary(count=2, kv_bytes=4096, p50_s=0.1, p99_s=0.2, gibps=1.0, seconds=0.3),
        kv_pool=KvPoolStats(
            indexed_blocks=1,
            pooled_tokens=4,
            spilled=1,
            dropped=0,
            loaded=2,
            unusable=0,
            load_bytes=64,
            load_gib_s=0.1,
            host_bytes=64,
            disk_bytes=64,
            faults=[PoolFault("disk", "write", "ENOSPC", 3)],
            tiers=[StageTier(stage=1, tier="disk", path="/d", state="paused", reason="write ENOSPC")],
        ),
    )
    served: dict[str, set[str]] = {}  # sample name -> its labels
    for family in text_string_to_metric_families(render(stats, "m", "kvasir", {0: 20}).decode()):
        for sample in family.samples:
            served.setdefault(sample.name, set()).update(sample.labels)
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    assert len(queries) >= 20
    for query in queries:
        names = re.findall(r"kvasir:[a-z0-9_]+", query)
        assert names, query
        for name in names:
            assert name in served, f"{name} is not served ({query})"
        labels = set(re.findall(r"([a-z_]+)\s*=~?\s*\"", query)) | {
            word for group in re.findall(r"by \(([^)]*)\)", query) for word in re.split(r"[,\s]+", group) if word
        }
        known = set.union(*(served[name] for name in names)) | {"le"}
        assert labels <= known, f"{sorted(labels - known)} not among the labels of {names}"
    legends = " ".join(target.get("legendFormat", "") for panel in dashboard["panels"] for target in panel["targets"])
    every_label = set.union(*served.values())
    assert set(re.findall(r"\{\{(\w+)\}\}", legends)) <= every_label
    covered = " ".join(queries)
    for series in ("worker_busy", "worker_starved", "worker_blocked", "handoff", "prefix_cache", 'role="shard"'):
        assert series in covered  # the list: per stage, hand-off, prefix hits, experts


def test_a_kv_pools_series_are_served_only_with_a_pool():
    from kvasir.wire.pool_stats import KvPoolStats, StageTier
    from kvasir.wire.stats import PoolFault

    figures = dict(spilled=9, dropped=1, loaded=14, unusable=2, load_bytes=4096, load_gib_s=0.5)
    pool = KvPoolStats(indexed_blocks=7, pooled_tokens=28, host_bytes=100, disk_bytes=300, **figures)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(render(one_request(kv_pool=pool), "m").decode())
        for s in f.samples
    }
    model = (("model_name", "m"),)
    assert samples[("kvasir:kv_pool_read_tokens_total", model)] == 28
    assert samples[("kvasir:kv_pool_unusable_slices_total", model)] == 2
    assert samples[("kvasir:kv_pool_bytes", (*model, ("tier", "disk")))] == 300
    faulty = msgspec.structs.replace(
        pool,
        faults=[PoolFault("disk", "write", "ENOSPC", 3), PoolFault("host", "read", "EIO", 1)],
        tiers=[StageTier(stage=s, tier="disk", path="/d", state="paused", reason="write ENOSPC") for s in (0, 1)],
    )
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(render(one_request(kv_pool=faulty), "m").decode())
        for s in f.samples
    }
    disk_full = (*model, ("op", "write"), ("reason", "ENOSPC"), ("tier", "disk"))
    assert samples[("kvasir:kv_pool_errors_total", disk_full)] == 3
    assert samples[("kvasir:kv_pool_errors_total", (*model, ("op", "read"), ("reason", "EIO"), ("tier", "host")))] == 1
    assert samples[("kvasir:kv_pool_tiers_down", (*model, ("state", "paused"), ("tier", "disk")))] == 2
    plain = render(one_request(), "m").decode()
    assert "kv_pool" not in plain


def test_the_planners_decisions_and_readings():
    from kvasir.wire.fleet import PlannerDecision, PlannerStats

    last = PlannerDecision(
        action="hold", reason="both pools meet their targets", ttft_s=0.5, itl_s=None, prefill_busy=0.25
    )
    planner = PlannerStats(
        ttft_s=2.0, itl_s=0.2, percentile=90, interval_s=10, decisions={"hold": 7, "move": 2}, last=last
    )
    stats = DaemonStats(
        uptime_s=1.0,
        requests=0,
        in_flight=0,
        waiting_limit=10,
        vocab_size=100,
        max_seq_len=64,
        stages=[],
        planner=planner,
    )
    text = render(stats, "m").decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    decisions = {s.labels["action"]: s.value for s in families["kvasir:planner_decisions"].samples}
    assert decisions == {"move": 2.0, "hold": 7.0}
    assert [s.value for s in families["kvasir:planner_ttft_seconds"].samples] == [0.5]
    assert families["kvasir:planner_itl_seconds"].samples == []  # no sample in the last interval
    assert [s.value for s in families["kvasir:planner_itl_target_seconds"].samples] == [0.2]
    assert 'kvasir:planner_decisions_total{action="move",model_name="m"} 2.0' in text
    busy = {s.labels["pool"]: s.value for s in families["kvasir:planner_busy_ratio"].samples}
    assert busy == {"prefill": 0.25}  # the decode pool's was not measured
