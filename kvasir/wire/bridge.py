"""Stages to the bridge (``BridgeMessage``): sampled tokens, ended requests and statistics."""

from __future__ import annotations

from kvasir.config.plan import Pool
from kvasir.wire.base import Tagged, Wire
from kvasir.wire.batch import PromptScores, SampledToken


# -- stages to the bridge -----------------------------------------------------------------
class TokenEvents(Tagged, frozen=True):
    tokens: tuple[SampledToken, ...]
    prompt: tuple[PromptScores, ...] = ()  # prompt chunks scored in the same batch (before its tokens)


class RequestEnded(Tagged, frozen=True):
    """The head ended a request without a token: cancelled, or refused (code + message)."""

    request_id: int
    code: str  # "cancelled" or an error code
    message: str = ""


class BatchSpan(Wire, frozen=True):
    """One batch on one stage: when the stage took it and handed it on, and what it held."""

    batch_id: int
    start_ns: int  # CLOCK_MONOTONIC, comparable across the daemon's processes
    end_ns: int
    prefill_tokens: int  # tokens of multi-token rows (prompt chunks)
    decode_tokens: int  # tokens of single-token rows


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
    inflight: int  # batches in flight (head only; 0 elsewhere)
    kv_requests: int  # requests whose KV the stage holds
    kv_blocks: int  # KV blocks those requests hold on this stage
    waiting: int = 0  # requests queued for admission (head only; 0 elsewhere)
    hop_s: float = 0.0  # of busy and waiting time: spent handing boundaries over (slots, descriptors, credits)
    spans: tuple[BatchSpan, ...] = ()  # batches run since the previous report (the bridge keeps a bounded timeline)
    pool: Pool = ""
    handoff_bytes: int = 0  # decode stages: KV bytes received from the prefill pool
    handoff_s: float = 0.0  # decode stages: of busy time, spent copying them
    handing_off: int = 0  # prefill head: requests handed to the decode pool, not yet taken (their blocks held)
    device: str = "cpu"  # where the stage's slice, KV cache and attention live
    gpu_bytes: int = 0  # CUDA stages: device memory held by live tensors (weights, KV cache, slots, activations)
    gpu_reserved_bytes: int = 0  # CUDA stages: device memory reserved by the caching allocator
    expert_tokens: tuple[int, ...] = ()  # MoE stages: tokens routed to each expert (one per top-k pick), all layers
    expert_imbalance: float = 0.0  # MoE stages: the busiest expert's tokens over the mean (1.0: even)
    dispatch_s: float = 0.0  # stages with expert shards: of busy time, spent dispatching rows and combining
    host: str = ""  # a plan across hosts: the host it runs on
    prefix_queries: int = 0  # heads: admitted prompts looked up in the prefix cache
    prefix_prompt_tokens: int = 0  # heads: their tokens
    prefix_hit_tokens: int = 0  # heads: of those, reused from the cache
    prefix_cached_blocks: int = 0  # heads: blocks in the cache now (held by requests or idle)
    prefix_evicted: int = 0  # heads: cached blocks given up for room


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


class HandoffReport(Tagged, frozen=True):
    """Decode head -> bridge: one request's KV hand-off, measured."""

    request_id: int
    nbytes: int  # KV bytes moved, all decode stages together
    seconds: float  # from the prefill tail handing the request over to the last decode stage's copy
    copy_s: float  # the slowest decode stage's copy (they copy in parallel)


BridgeMessage = TokenEvents | RequestEnded | StageStats | ShardStats | HandoffReport
