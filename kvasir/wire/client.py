"""Clients and the bridge: ``ClientMessage`` in, ``ClientEvent`` out (JSON-friendly structs
with a ``type`` tag; the same bodies as msgpack on the socket)."""

from __future__ import annotations

from typing import Annotated

import msgspec

from kvasir.wire.base import (
    MAX_BAD_WORD_CHARS,
    MAX_BAD_WORD_TEXTS,
    MAX_LOGIT_BIAS,
    MAX_STOP_TOKEN_IDS,
    DaemonState,
    FinishReason,
    Grammar,
)
from kvasir.wire.fleet import InstanceStats, MoveTarget, PlannerStats
from kvasir.wire.pool_stats import KvPoolStats
from kvasir.wire.stats import BatchSpan, DraftCounters, ShardStats, StageStats

# Size limits of a client's submission, checked while decoding (msgspec reads a list's
# length before its items, so an oversized list is refused without being walked). The
# model's own limits (max_seq_len, vocabulary) are checked after, in kvasir/sched/validation.py.
MAX_PROMPT_TOKENS = 1 << 20  # token ids in one prompt (max_seq_len is the real bound)


MAX_PROMPT_CHARS = 1 << 22  # characters of one prompt text
MAX_NAMESPACE_CHARS = 1024  # characters of a tenant or a cache_salt
Namespace = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NAMESPACE_CHARS)]


# -- clients ----------------------------------------------------------------------------------
class _Client(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="type", kw_only=True):
    pass


class Submit(_Client, frozen=True, tag="submit"):
    key: int  # the client's own handle for the request, echoed in Accepted
    prompt: Annotated[str, msgspec.Meta(max_length=MAX_PROMPT_CHARS)] | None = None
    token_ids: Annotated[list[int], msgspec.Meta(max_length=MAX_PROMPT_TOKENS)] | None = None
    chat: bool = False
    max_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: Annotated[list[int], msgspec.Meta(max_length=MAX_STOP_TOKEN_IDS)] = []
    ignore_eos: bool = False
    logprobs: int | None = None  # N: each token's log-probability and the N most likely tokens' (0 <= N <= 20)
    prompt_logprobs: int | None = None  # N: the same for every prompt token after the first (PromptLogprobs events)
    cache_salt: Namespace | None = None  # share prefix-cache blocks only with requests giving the same salt
    tenant: Namespace | None = None  # local clients serving others (the HTTP front): the caller's cache namespace
    session: Namespace | None = None  # a conversation's or user's id: its requests stay on one instance while it serves
    # the logits' processing before sampling (kvasir/stage/logits.py), vLLM's meanings
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: Annotated[dict[int, float], msgspec.Meta(max_length=MAX_LOGIT_BIAS)] = {}
    min_tokens: int = 0
    bad_words: Annotated[
        list[Annotated[str, msgspec.Meta(max_length=MAX_BAD_WORD_CHARS)]], msgspec.Meta(max_length=MAX_BAD_WORD_TEXTS)
    ] = []  # texts: never completed in the output (the bridge tokenizes them)
    skip_special_tokens: bool = True  # leave special tokens out of the text (their ids still come)
    grammar: Grammar | None = None  # structured output: a JSON schema, a regex, choices or a Lark grammar
    speculative: bool = True  # False: no draft tokens for it where the plan has [speculative] (same output)


class Cancel(_Client, frozen=True, tag="cancel"):
    request_id: int


class StatsQuery(_Client, frozen=True, tag="stats"):
    key: int
    timeline: bool = False  # include each stage's recent batch spans


InstanceName = Annotated[str, msgspec.Meta(min_length=1, max_length=32)]


class Move(_Client, frozen=True, tag="move"):
    """Move an instance to another pool (``kvasir instances move``; local clients only)."""

    key: int
    instance: InstanceName
    to: MoveTarget


class DrainHost(_Client, frozen=True, tag="drain_host"):
    """Drain a host: its instances finish their requests and park (``kvasir hosts drain``; local clients only)."""

    key: int
    host: Annotated[str, msgspec.Meta(min_length=1, max_length=63)]


ClientMessage = Submit | Cancel | StatsQuery | Move | DrainHost


class Accepted(_Client, frozen=True, tag="accepted"):
    key: int
    request_id: int


class TokenOut(_Client, frozen=True, tag="token"):
    request_id: int
    index: int
    token_id: int
    text: str
    logprob: float | None = None  # a request with logprobs: the token's log-probability under the model
    top_logprobs: list[tuple[int, float]] | None = None  # and the most likely tokens' (id, log-probability)


class PromptLogprobs(_Client, frozen=True, tag="prompt_logprobs"):
    """A request with prompt_logprobs: a run of its prompt tokens' log-probabilities, each
    given the tokens before it, in prompt order (before the request's first token)."""

    request_id: int
    first: int  # position of token_ids[0] in the prompt (>= 1)
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]  # per token, the most likely tokens' (id, log-probability)


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # of prompt_tokens, reused from the prefix cache instead of computed
    cached_host_tokens: int = 0  # of cached_tokens, read back from the KV pool's host memory tier
    cached_disk_tokens: int = 0  # and from its disk tier
    cached_remote_tokens: int = 0  # and from another host's pool (the rest was in the instance's own cache)


class Timings(msgspec.Struct, frozen=True, kw_only=True):
    queued_s: float  # submission to the request's first batch
    first_token_s: float  # submission to the first token (TTFT)
    per_token_s: float  # mean time between output tokens after the first
    total_s: float
    second_token_s: float | None = None  # first to second token (in a disaggregated plan it includes the KV hand-off)


class HandoffTimings(msgspec.Struct, frozen=True, kw_only=True):
    """A request's KV hand-off between pools (disaggregated plans only)."""

    kv_bytes: int
    seconds: float  # first token sampled (prefill pool) -> every decode stage holds the KV
    copy_s: float  # of which copying (the slowest decode stage; they copy in parallel)
    gibps: float  # effective bandwidth of the copy: kv_bytes / copy_s, in GiB/s


class Drafts(msgspec.Struct, frozen=True, kw_only=True):
    """Speculative decoding's part in a request (docs/speculative.md)."""

    passes: int  # passes of the model that emitted its tokens
    drafted: int  # draft tokens checked for it
    accepted: int  # of those, confirmed (each one a token without a pass of its own)
    acceptance: float  # accepted / drafted
    tokens_per_pass: float  # its tokens / passes (1.0 without drafts)

    @classmethod
    def of(cls, tokens: int, passes: int, drafted: int, accepted: int) -> Drafts | None:
        """From the tail's counts on a request's last token; None where no draft was checked."""
        if drafted <= 0 or passes <= 0:
            return None
        accepted = min(max(accepted, 0), drafted)
        return cls(
            passes=passes,
            drafted=drafted,
            accepted=accepted,
            acceptance=accepted / drafted,
            tokens_per_pass=tokens / passes,
        )


class Finished(_Client, frozen=True, tag="finished"):
    request_id: int
    reason: FinishReason
    token_ids: list[int]
    usage: Usage
    timings: Timings
    handoff: HandoffTimings | None = None
    instances: list[str] = []  # the instance that served it (disaggregated: its prefill, then its decode instance)
    route: str = ""  # why the conductor sent it there (kvasir/bridge/conductor.py)
    drafts: Drafts | None = None  # speculative decoding: its drafts' fate (None: no draft was checked)


class Cancelled(_Client, frozen=True, tag="cancelled"):
    request_id: int


class ErrorEvent(_Client, frozen=True, tag="error"):
    code: str
    message: str
    request_id: int | None = None
    key: int | None = None  # set when the error answers a submission before it had an id


class PrefixCacheStats(msgspec.Struct, frozen=True, kw_only=True):
    """The heads' prefix caches since the ring (re)started: a restart empties them."""

    queries: int  # admitted prompts looked up
    prompt_tokens: int  # their tokens
    hit_tokens: int  # of those, reused from the cache instead of computed
    hit_rate: float  # hit_tokens / prompt_tokens (0 before any query)
    cached_blocks: int  # blocks in the cache now (held by requests or idle)
    evicted: int  # cached blocks given up for room

    def describe(self) -> str:
        """One line for ``kvasir stats`` and ``kvasir top``."""
        return (
            f"prefix cache: {self.queries} prompts looked up, {self.hit_tokens} of {self.prompt_tokens} prompt "
            f"tokens reused ({self.hit_rate:.0%}); {self.cached_blocks} blocks cached, {self.evicted} evicted"
        )

    @classmethod
    def of(cls, stages: list[StageStats]) -> PrefixCacheStats:
        """Summed over the stages' reports (only heads report any)."""
        caches = [s.prefix for s in stages if s.prefix is not None]
        prompt = sum(c.prompt_tokens for c in caches)
        hits = sum(c.hit_tokens for c in caches)
        return cls(
            queries=sum(c.queries for c in caches),
            prompt_tokens=prompt,
            hit_tokens=hits,
            hit_rate=hits / prompt if prompt else 0.0,
            cached_blocks=sum(c.cached_blocks for c in caches),
            evicted=sum(c.evicted for c in caches),
        )


class DaemonStats(msgspec.Struct, frozen=True, kw_only=True):
    uptime_s: float
    requests: int  # accepted since start
    in_flight: int  # accepted and not yet ended
    tokens_out: int = 0  # output tokens streamed to clients since start
    waiting_limit: int
    vocab_size: int
    max_seq_len: int
    stages: list[StageStats]
    shards: list[ShardStats] = []  # expert shards, by number
    timeline: list[list[BatchSpan]] = []  # per stage, oldest first (only when asked for)
    state: DaemonState = "serving"  # "restarting": a child failed, new requests get "restarting"
    restarts: int = 0  # ring restarts since the daemon started
    last_failure: str | None = None  # what the last failure was (a child's exit, a missed heartbeat)
    last_failure_age_s: float | None = None  # seconds since it
    handoff: HandoffSummary | None = None  # disaggregated plans: KV hand-offs since start
    client_bytes_waiting: int = 0  # events queued in the bridge for clients that read slower than they are sent
    clients_lost: int = (
        0  # clients the bridge gave up on (gone, or not reading): their requests cancelled, events dropped
    )
    malformed: int = 0  # internal messages the bridge dropped because they did not decode
    hosts_missing: list[str] = []  # a plan across hosts: hosts with workers whose kvasird join is not there
    metrics: RequestMetrics | None = None  # latency histograms and request counters
    prefix_cache: PrefixCacheStats | None = None  # the heads' prefix caches (None: no stage reported yet)
    instances: list[InstanceStats] = []  # each instance (kvasir/config/fleet.py), in plan order
    kv_pool: KvPoolStats | None = None  # a plan with [kv_pool]
    drafts: DraftCounters | None = None  # a plan with [speculative]: its heads' and tails' counts, summed
    planner: PlannerStats | None = None  # a plan with [planner] enabled = true: its decisions

    def prefix_cache_line(self) -> str | None:
        """The prefix cache's line for ``kvasir stats`` and ``kvasir top``; None until it is used."""
        cache = self.prefix_cache
        return cache.describe() if cache is not None and (cache.queries or cache.cached_blocks) else None


class Histogram(msgspec.Struct, frozen=True, kw_only=True):
    """Observations counted per bucket: ``counts[i]`` fell at or under ``bounds[i]`` and
    over the bound before; the last count is over every bound (+Inf)."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]  # len(bounds) + 1, not cumulative
    sum: float


class RequestMetrics(msgspec.Struct, frozen=True, kw_only=True):
    """Every request since the daemon started, whichever door it came in by (the HTTP
    front's /metrics reads these; vLLM's names for the same things)."""

    time_to_first_token_s: Histogram  # submission to the first token
    inter_token_latency_s: Histogram  # between consecutive tokens of a request, as clients see them
    e2e_request_latency_s: Histogram  # submission to the last token
    request_queue_time_s: Histogram  # submission to the request's first batch
    prompt_tokens: int  # of accepted requests
    generation_tokens: int  # streamed to clients
    ended: dict[str, int]  # requests ended, by reason: "stop", "length", "abort" (cancelled), "error"
    request_prompt_tokens: Histogram | None = None  # prompt tokens of each finished request
    request_generation_tokens: Histogram | None = None  # output tokens of each finished request


class HandoffSummary(msgspec.Struct, frozen=True, kw_only=True):
    count: int  # requests handed from the prefill pool to the decode pool
    kv_bytes: int  # in all
    p50_s: float  # hand-off time (first token sampled -> decode holds the KV), over the most recent hand-offs
    p99_s: float
    gibps: float  # effective copy bandwidth over the most recent hand-offs: their bytes / their copy time
    seconds: float = 0.0  # hand-off time since start, all hand-offs together


class StatsReply(_Client, frozen=True, tag="stats"):
    key: int
    stats: DaemonStats


class MoveStarted(_Client, frozen=True, tag="move_started"):
    """The bridge took a move: nothing new goes to the instance; it waits for ``requests``."""

    key: int
    instance: str
    to: MoveTarget
    requests: int  # on the instance now: the move waits for them to finish


class DrainStarted(_Client, frozen=True, tag="drain_started"):
    """The bridge took a drain: nothing new goes to the host's ``instances``; they park
    once the ``requests`` on them finished."""

    key: int
    host: str
    instances: list[str]  # those that leave (already parked ones are not listed)
    requests: int


ClientEvent = (
    Accepted | TokenOut | PromptLogprobs | Finished | Cancelled | ErrorEvent | StatsReply | MoveStarted | DrainStarted
)
