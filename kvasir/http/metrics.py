"""``/metrics``: the daemon's statistics (one stats query to the bridge) as Prometheus
series, through prometheus_client's own exposition. Names follow vLLM's where the
meaning is the same, under ``kvasir:`` (or ``vllm:``, ``[http] metrics_prefix``, so
vLLM's published dashboards read Kvasir unchanged); every series carries ``model_name``.

The values come from the bridge, not from this front process, so every front worker
(``http.workers``) answers the same numbers and requests through the ZeroMQ door count too.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from itertools import accumulate

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from kvasir.wire.client import DaemonStats, Histogram
from kvasir.wire.fleet import InstanceStats, PlannerStats
from kvasir.wire.pool_stats import KvPoolStats
from kvasir.wire.stats import DraftCounters, ShardStats, StageStats

CONTENT_TYPE = CONTENT_TYPE_LATEST
WORKER = ["model_name", "role", "stage", "pool", "shard", "host", "instance"]
INSTANCE = ["model_name", "instance", "pool"]
HISTOGRAMS = (
    ("time_to_first_token_seconds", "time_to_first_token_s", "Time from submission to the first token."),
    ("inter_token_latency_seconds", "inter_token_latency_s", "Time between consecutive output tokens of a request."),
    ("e2e_request_latency_seconds", "e2e_request_latency_s", "Time from submission to the last token."),
    ("request_queue_time_seconds", "request_queue_time_s", "Time from submission to the request's first batch."),
)
WORKER_TIMES = (
    ("busy", "Seconds the worker held a batch (docs/architecture.md, busy, starved, blocked)."),
    ("starved", "Seconds the worker could have run but had nothing to run."),
    ("blocked", "Seconds a finished batch waited for a free slot downstream."),
)


def render(
    stats: DaemonStats, model_name: str, prefix: str = "kvasir", kv_capacity: dict[int, int] | None = None
) -> bytes:
    """The exposition text of one stats snapshot; ``kv_capacity``: each instance's KV
    blocks by its head's stage (the KV cache usage fraction's denominator)."""
    return generate_latest(_Snapshot(stats, model_name, prefix, kv_capacity or {}))  # type: ignore[arg-type]


class _Snapshot:
    """What generate_latest reads: an object whose ``collect`` yields metric families."""

    def __init__(self, stats: DaemonStats, model_name: str, prefix: str, kv_capacity: dict[int, int]) -> None:
        self.stats = stats
        self.model = model_name
        self.prefix = prefix
        self.kv_capacity = kv_capacity

    def _name(self, name: str) -> str:
        return f"{self.prefix}:{name}"

    def collect(self) -> Iterator[Metric]:
        yield from self._requests()
        yield from self._workers()
        yield from self._daemon()

    def _requests(self) -> Iterator[Metric]:
        stats, model = self.stats, [self.model]
        metrics = stats.metrics
        waiting = sum(stage.head.waiting for stage in stats.stages if stage.head is not None)
        yield self._gauge(
            "num_requests_running",
            "Requests in the daemon not waiting for admission.",
            model,
            max(0, stats.in_flight - waiting),
        )
        yield self._gauge("num_requests_waiting", "Requests queued at a head for admission.", model, waiting)
        yield self._gauge(
            "kv_cache_usage_perc", "KV cache blocks in use, a fraction of the heads' blocks.", model, self._kv_usage()
        )
        if metrics is None:
            return
        for name, field, doc in HISTOGRAMS:
            yield self._histogram(name, doc, model, getattr(metrics, field))
        yield self._histogram(
            "time_per_output_token_seconds",
            "vLLM's older name of the inter-token latency.",
            model,
            metrics.inter_token_latency_s,
        )
        for name, histogram, doc in (
            ("request_prompt_tokens", metrics.request_prompt_tokens, "Prompt tokens of each finished request."),
            ("request_generation_tokens", metrics.request_generation_tokens, "Output tokens of each finished request."),
        ):
            if histogram is not None:
                yield self._histogram(name, doc, model, histogram)
        yield self._counter("prompt_tokens", "Prompt tokens of accepted requests.", model, metrics.prompt_tokens)
        yield self._counter("generation_tokens", "Output tokens streamed to clients.", model, metrics.generation_tokens)
        ended = CounterMetricFamily(
            self._name("request_success"),
            "Requests ended, by finish reason (abort: cancelled).",
            labels=["model_name", "finished_reason"],
        )
        for reason, count in metrics.ended.items():
            ended.add_metric([self.model, reason], count)
        yield ended

    def _workers(self) -> Iterator[Metric]:
        stats = self.stats
        rows: list[tuple[list[str], StageStats | ShardStats]]
        instance = {index: i.name for i in stats.instances for index in i.stages}
        rows = [(["stage", str(s.index), s.pool, "", s.host, s.instance], s) for s in stats.stages]
        rows += [
            (["shard", str(s.stage), s.pool, str(s.number), s.host, instance.get(s.stage, "")], s) for s in stats.shards
        ]
        for kind, doc in WORKER_TIMES:
            family = CounterMetricFamily(self._name(f"worker_{kind}_seconds"), doc, labels=WORKER)
            for labels, worker in rows:
                family.add_metric([self.model, *labels], getattr(worker, f"{kind}_s"))
            yield family
        blocks = GaugeMetricFamily(
            self._name("kv_blocks_in_use"), "KV blocks held by running requests, per stage.", labels=WORKER
        )
        for s in stats.stages:
            blocks.add_metric([self.model, "stage", str(s.index), s.pool, "", s.host, s.instance], s.kv.blocks)
        yield blocks
        yield from self._instances()

    def _instances(self) -> Iterator[Metric]:
        """Per instance (kvasir/config/fleet.py): serving or not, its load, routing and cache."""
        families = (
            (GaugeMetricFamily, "instance_serving", "1 while the instance serves, 0 while it restarts.", "serving"),
            (GaugeMetricFamily, "instance_parked", "1 while its standby or drained host is away.", "parked"),
            (GaugeMetricFamily, "instance_requests_running", "Requests on the instance now.", "requests"),
            (CounterMetricFamily, "instance_routed", "Requests the conductor sent to the instance.", "routed"),
            (CounterMetricFamily, "instance_restarts", "Restarts of the instance after a failure.", "restarts"),
            (CounterMetricFamily, "instance_moves", "Moves of the instance to another pool.", "moves"),
            (CounterMetricFamily, "instance_prefix_cache_hit_tokens", "Prompt tokens its head's cache reused.", "hits"),
            (CounterMetricFamily, "instance_prefix_cache_query_tokens", "Prompt tokens its head looked up.", "queries"),
        )
        for kind, name, doc, field in families:
            family = kind(self._name(name), doc, labels=INSTANCE)
            for i in self.stats.instances:
                family.add_metric([self.model, i.name, i.pool], _instance_value(i, field))
            yield family

    def _daemon(self) -> Iterator[Metric]:
        stats, model = self.stats, [self.model]
        handoff = stats.handoff
        yield self._counter(
            "handoffs", "KV hand-offs from the prefill pool to the decode pool.", model, handoff.count if handoff else 0
        )
        yield self._counter(
            "handoff_bytes",
            "KV bytes handed from the prefill pool to the decode pool.",
            model,
            handoff.kv_bytes if handoff else 0,
        )
        yield self._counter(
            "handoff_seconds", "Seconds of KV hand-offs, all together.", model, handoff.seconds if handoff else 0.0
        )
        yield self._counter("restarts", "Ring restarts after a failed worker.", model, stats.restarts)
        cache = stats.prefix_cache
        yield self._counter(
            "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache (since the ring last started).",
            model,
            cache.prompt_tokens if cache else 0,
        )
        yield self._counter(
            "prefix_cache_hits",
            "Prompt tokens found in the prefix cache (since the ring last started).",
            model,
            cache.hit_tokens if cache else 0,
        )
        yield self._gauge(
            "serving",
            "1 while the daemon takes requests, 0 while it restarts or drains.",
            model,
            int(stats.state == "serving"),
        )
        if (pool := stats.kv_pool) is not None:
            yield from self._kv_pool(pool, model)
        if (drafts := stats.drafts) is not None:
            yield from self._drafts(drafts, model)
        if (planner := stats.planner) is not None:
            yield from self._planner(planner)

    def _planner(self, planner: PlannerStats) -> Iterator[Metric]:
        """The planner (a plan with [planner] enabled = true): its decisions, its last readings."""
        decisions = CounterMetricFamily(
            self._name("planner_decisions"), "The planner's decisions, by action.", labels=["model_name", "action"]
        )
        for action in ("move", "hold"):
            decisions.add_metric([self.model, action], planner.decisions.get(action, 0))
        yield decisions
        last = planner.last
        for name, doc, value, target in (
            ("ttft", "time to first token", last.ttft_s if last else None, planner.ttft_s),
            ("itl", "inter-token latency", last.itl_s if last else None, planner.itl_s),
        ):
            reading = GaugeMetricFamily(
                self._name(f"planner_{name}_seconds"),
                f"The planner's last interval: {doc} at its percentile (absent without a sample).",
                labels=["model_name"],
            )
            if value is not None:
                reading.add_metric([self.model], value)
            yield reading
            yield self._gauge(f"planner_{name}_target_seconds", f"The planner's target {doc}.", [self.model], target)
        busy = GaugeMetricFamily(
            self._name("planner_busy_ratio"),
            "The planner's last interval: each pool's busy share (its instances' busiest stage, averaged).",
            labels=["model_name", "pool"],
        )
        for pool, share in (
            ("prefill", last.prefill_busy if last else None),
            ("decode", last.decode_busy if last else None),
        ):
            if share is not None:
                busy.add_metric([self.model, pool], share)
        yield busy

    def _drafts(self, drafts: DraftCounters, model: list[str]) -> Iterator[Metric]:
        """Speculative decoding (a plan with [speculative]), vLLM's names where it has them."""
        for name, doc, value in (
            ("spec_decode_num_drafts", "Decode rows that carried draft tokens.", drafts.draft_rows),
            ("spec_decode_num_draft_tokens", "Draft tokens checked by the model.", drafts.drafted),
            ("spec_decode_num_accepted_tokens", "Draft tokens the model confirmed.", drafts.accepted),
            ("spec_decode_passes", "Rows that emitted tokens (one pass of the model each).", drafts.rows),
            ("spec_decode_pass_tokens", "Tokens those rows emitted.", drafts.tokens),
        ):
            yield self._counter(name, doc, model, value)
        skipped = CounterMetricFamily(
            self._name("spec_decode_rows_without_drafts"),
            "Decode rows speculation left without drafts, by why.",
            labels=["model_name", "reason"],
        )
        skipped.add_metric([self.model, "batch_full"], drafts.full_rows)
        skipped.add_metric([self.model, "low_acceptance"], drafts.quiet_rows)
        yield skipped

    def _kv_pool(self, pool: KvPoolStats, model: list[str]) -> Iterator[Metric]:
        """The KV pool (a plan with [kv_pool]): what it read back and wrote, what it holds."""
        for name, doc, value in (
            (
                "kv_pool_read_tokens",
                "Prompt tokens read back from the KV pool instead of computed.",
                pool.pooled_tokens,
            ),
            ("kv_pool_read_bytes", "Bytes of KV slices the stages read back from the pool.", pool.load_bytes),
            (
                "kv_pool_written_slices",
                "Stage slices of evicted prefix blocks queued to be written down.",
                pool.spilled,
            ),
            ("kv_pool_dropped_slices", "Stage slices dropped: a stage's write queue was full.", pool.dropped),
            ("kv_pool_unusable_slices", "Slices missing, corrupt or mismatched when read (recomputed).", pool.unusable),
        ):
            yield self._counter(name, doc, model, value)
        tiers = GaugeMetricFamily(
            self._name("kv_pool_bytes"), "Bytes the pool's slices take, per tier.", labels=["model_name", "tier"]
        )
        tiers.add_metric([*model, "host"], pool.host_bytes)
        tiers.add_metric([*model, "disk"], pool.disk_bytes)
        yield tiers
        faults = CounterMetricFamily(
            self._name("kv_pool_errors"),
            "Storage faults of the pool's tiers (each cost a cache hit, never a request), by tier, operation and reason.",
            labels=["model_name", "tier", "op", "reason"],
        )
        for fault in pool.faults:
            faults.add_metric([*model, fault.tier, fault.op, fault.reason], fault.count)
        yield faults
        down = GaugeMetricFamily(
            self._name("kv_pool_tiers_down"),
            "Stages' pool tiers that do not serve now: paused after faults, or refused at start.",
            labels=["model_name", "tier", "state"],
        )
        for key, count in sorted(Counter((t.tier, t.state) for t in pool.tiers).items()):
            down.add_metric([*model, *key], count)
        yield down

    def _kv_usage(self) -> float:
        """Blocks held at the heads over the blocks their instances have."""
        heads = [s for s in self.stats.stages if s.index in self.kv_capacity]
        total = sum(self.kv_capacity[s.index] for s in heads)
        return sum(s.kv.blocks for s in heads) / total if total else 0.0

    def _gauge(self, name: str, doc: str, labels: list[str], value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(self._name(name), doc, labels=["model_name"])
        family.add_metric(labels, value)
        return family

    def _counter(self, name: str, doc: str, labels: list[str], value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(self._name(name), doc, labels=["model_name"])
        family.add_metric(labels, value)
        return family

    def _histogram(self, name: str, doc: str, labels: list[str], histogram: Histogram) -> HistogramMetricFamily:
        family = HistogramMetricFamily(self._name(name), doc, labels=["model_name"])
        cumulative = list(accumulate(histogram.counts))
        edges = [repr(float(bound)) for bound in histogram.bounds] + ["+Inf"]
        family.add_metric(labels, list(zip(edges, cumulative)), histogram.sum)
        return family


def _instance_value(instance: InstanceStats, field: str) -> float:
    prefix = instance.prefix
    if field in ("serving", "parked"):
        return 1.0 if instance.state == field else 0.0
    if field == "hits":
        return prefix.hit_tokens if prefix is not None else 0
    if field == "queries":
        return prefix.prompt_tokens if prefix is not None else 0
    return getattr(instance, field)
