"""Statistics the workers report to the bridge (``StageStats``, ``ShardStats``): the
figures every worker has at the top level, each feature's counters in a struct of its
own, present only where the feature runs (a head's queue, its prefix cache, a decode
stage's hand-off, a MoE stage's expert load, a CUDA stage's memory)."""

from __future__ import annotations

from typing import Literal

from kvasir.config.sections import Pool
from kvasir.wire.base import Tagged, Wire


class BatchSpan(Wire, frozen=True):
    """One batch on one stage: when the stage took it and handed it on, and what it held."""

    batch_id: int
    start_ns: int  # CLOCK_MONOTONIC, comparable across the daemon's processes
    end_ns: int
    prefill_tokens: int  # tokens of multi-token rows (prompt chunks)
    decode_tokens: int  # tokens of single-token rows


class KvUse(Wire, frozen=True):
    """The KV a stage holds now."""

    requests: int = 0  # requests whose KV the stage holds
    blocks: int = 0  # KV blocks they hold on this stage


class HeadQueue(Wire, frozen=True):
    """A ring head's queue and batches."""

    inflight: int = 0  # batches in flight round the ring
    waiting: int = 0  # requests queued for admission (a decode head: also those whose KV is on its way)
    handing_off: int = 0  # a prefill head: requests handed to the decode pool, not yet taken (their blocks held)


class PrefixCounters(Wire, frozen=True):
    """A head's prefix cache since the ring (re)started."""

    queries: int = 0  # admitted prompts looked up
    prompt_tokens: int = 0  # their tokens
    hit_tokens: int = 0  # of those, reused from the cache
    cached_blocks: int = 0  # blocks in the cache now (held by requests or idle)
    evicted: int = 0  # cached blocks given up for room
    pooled_tokens: int = 0  # of hit_tokens, read back from the KV pool (its tiers below the cache)


class DraftCounters(Wire, frozen=True):
    """Speculative decoding since the ring (re)started (a plan with [speculative]): a
    head's rows without drafts, a tail's verdicts on the drafts it checked."""

    rows: int = 0  # tail: emitting rows sampled (each one pass of the model)
    tokens: int = 0  # tail: tokens they emitted (tokens per pass: tokens / rows)
    draft_rows: int = 0  # tail: of the rows, those that carried drafts
    drafted: int = 0  # tail: draft tokens checked
    accepted: int = 0  # tail: of those, confirmed by the model's own samples
    full_rows: int = 0  # head: decode rows not drafted for: their batch had more than speculative.max_rows
    quiet_rows: int = 0  # head: decode rows not drafted for: their request's drafts were rarely confirmed

    def __add__(self, other: DraftCounters) -> DraftCounters:
        fields = self.__struct_fields__
        return DraftCounters(**{name: getattr(self, name) + getattr(other, name) for name in fields})

    @property
    def acceptance(self) -> float:
        """The share of drafts checked that the model confirmed (0 before any)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_pass(self) -> float:
        """Tokens emitted per emitting row (1.0 without drafts; 0 before any row)."""
        return self.tokens / self.rows if self.rows else 0.0

    def describe(self) -> str:
        """One line for ``kvasir stats`` and ``kvasir top``."""
        return (
            f"{self.accepted} of {self.drafted} drafts confirmed ({self.acceptance:.0%}), "
            f"{self.tokens_per_pass:.2f} tokens per pass; "
            f"rows without drafts: {self.full_rows} (batch full), {self.quiet_rows} (drafts rarely confirmed)"
        )


class PoolReads(Wire, frozen=True):
    """Slices a stage read back from one place: a tier of its host, or another host's
    stage (``peer``, its global index)."""

    tier: Literal["host", "disk", "remote"]
    slices: int
    bytes: int
    seconds: float
    peer: int = -1  # remote: the stage it read from


class PoolFault(Wire, frozen=True):
    """Storage faults of one kind on a tier (kvasir/kvpool/health.py): each cost a cache
    hit (a slice not written, or not read and computed), never a request."""

    tier: Literal["host", "disk"]
    op: Literal["open", "write", "read"]
    reason: str  # an errno's name (ENOSPC, EIO, EACCES...) or what was wrong with a file (short, size, mode...)
    count: int


class PoolTierState(Wire, frozen=True):
    """A stage's tier that does not serve: paused after faults, or refused at start."""

    tier: Literal["host", "disk"]
    path: str
    state: Literal["serving", "paused", "refused"]
    reason: str  # the last fault


class PoolCounters(Wire, frozen=True):
    """A stage's side of the KV pool since it started (kvasir/kvpool/stage_side.py)."""

    spilled: int = 0  # slices of evicted blocks queued to be written down
    dropped: int = 0  # of those offered, dropped: the write queue was full
    loaded: int = 0  # slices read back into the KV cache
    missing: int = 0  # slices asked for that no tier (nor the other host asked) had (computed)
    unusable: int = 0  # slices corrupt or made with something else (removed; computed)
    remote_bytes: int = 0  # of load_bytes, read from other hosts' pools
    remote_s: float = 0.0  # and the time those reads took
    load_bytes: int = 0  # bytes read back
    load_s: float = 0.0  # of busy time, spent reading slices back
    host_bytes: int = 0  # bytes its slices take in the host memory tier now
    disk_bytes: int = 0  # and in the disk tier
    reads: tuple[PoolReads, ...] = ()  # what it read back, by tier and remote stage
    faults: tuple[PoolFault, ...] = ()  # storage faults since it started, by tier, operation and reason
    tiers: tuple[PoolTierState, ...] = ()  # its tiers that do not serve now (paused or refused)


class HandoffCounters(Wire, frozen=True):
    """A decode stage's KV received from the prefill pool."""

    bytes: int = 0
    copy_s: float = 0.0  # of busy time, spent copying it


class ExpertLoad(Wire, frozen=True):
    """A MoE stage's routing since it started."""

    tokens: tuple[int, ...]  # tokens routed to each expert (one per top-k pick), all layers
    imbalance: float  # the busiest expert's tokens over the mean (1.0: even)
    dispatch_s: float = 0.0  # with expert shards: of busy time, spent dispatching rows and combining


class GpuMemory(Wire, frozen=True):
    """A CUDA stage's device memory."""

    allocated_bytes: int  # held by live tensors (weights, KV cache, slots, activations)
    reserved_bytes: int  # reserved by the caching allocator


class StageStats(Tagged, frozen=True):
    index: int
    layers: tuple[int, int]
    pid: int
    wall_s: float  # since the stage started serving
    busy_s: float
    starved_s: float
    blocked_s: float
    batches: int
    rows: int
    tokens: int
    kv: KvUse = KvUse()
    hop_s: float = 0.0  # of busy and waiting time: spent handing boundaries over (slots, descriptors, credits)
    spans: tuple[BatchSpan, ...] = ()  # batches run since the previous report (the bridge keeps a bounded timeline)
    pool: Pool = ""
    instance: str = ""  # its instance (ring) of its pool
    host: str = ""  # a plan across hosts: the host it runs on
    device: str = "cpu"  # where the stage's slice, KV cache and attention live
    head: HeadQueue | None = None  # a ring's head
    prefix: PrefixCounters | None = None  # a head with its prefix cache
    drafts: DraftCounters | None = None  # a head or tail of a plan with [speculative]
    handoff: HandoffCounters | None = None  # a decode pool's stage
    kv_pool: PoolCounters | None = None  # a plan with [kv_pool]
    experts: ExpertLoad | None = None  # a stage holding MoE layers
    gpu: GpuMemory | None = None  # a CUDA stage


class ShardStats(Tagged, frozen=True):
    """An expert shard's statistics, as a stage's (kvasir/wire/shares.py reads both)."""

    number: int
    stage: int  # its stage's global index
    experts: tuple[int, int]
    pid: int
    wall_s: float
    busy_s: float
    starved_s: float
    blocked_s: float  # always 0: a shard hands its result straight back
    dispatches: int  # layer dispatches computed
    tokens: int  # tokens routed to its experts (one per pick)
    expert_tokens: tuple[int, ...]  # of those, per expert of its range
    pool: Pool = ""
    host: str = ""  # a plan across hosts: the host it runs on
