"""What travels round the ring: a batch's descriptor (decided once by the head), its rows and
new requests, the tail's sampled tokens, and the credits that free boundary slots."""

from __future__ import annotations

from typing import Annotated

import msgspec

from kvasir.wire.base import FinishReason, Grammar, Wire

BLOCK_KEY_BYTES = 16  # a prefix-cache block key (kvasir/sched/prefix.py), and a request's namespace root
BlockKey = Annotated[bytes, msgspec.Meta(min_length=BLOCK_KEY_BYTES, max_length=BLOCK_KEY_BYTES)]


# -- requests and batches -------------------------------------------------------------
class SamplingParams(Wire, frozen=True):
    """How the tail picks tokens for one request and when it stops."""

    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # 1 = no nucleus filtering
    top_k: int = 0  # 0 = no top-k filtering
    seed: int | None = None  # same seed, same output
    max_tokens: int = 128  # output tokens at most
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # keep going past the model's end-of-sequence ids (benchmarks)
    logprobs: int = -1  # -1: none; N >= 0: each output token's log-probability and the N most likely tokens'
    prompt_logprobs: int = -1  # as logprobs, for every prompt token after the first (the tail scores the prompt)
    # the logits' processing before temperature (kvasir/stage/logits.py), vLLM's meanings
    presence_penalty: float = 0.0  # minus this for each token the output has
    frequency_penalty: float = 0.0  # minus this times the times the output has it
    repetition_penalty: float = 1.0  # tokens of the prompt or output: divided (> 0) or multiplied (< 0) by it
    min_p: float = 0.0  # after temperature: drop tokens less likely than min_p times the best
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, bias) added to its logit
    min_tokens: int = 0  # the stop tokens (end of sequence, stop_token_ids) are barred before this many
    bad_words: tuple[tuple[int, ...], ...] = ()  # token sequences never completed: the last is barred after the rest
    grammar: Grammar | None = None  # structured output: the output stays inside it (kvasir/stage/grammar.py)
    speculative: bool = True  # False: never drafted for where the plan has [speculative] (the output is the same)

    @property
    def penalises_output(self) -> bool:
        """Whether the penalties or bad words read the tokens output so far."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1 or self.bad_words)

    @property
    def needs_output(self) -> bool:
        """Whether the tail needs the tokens output so far (the penalties, bad words and grammar read them)."""
        return self.penalises_output or self.grammar is not None

    @property
    def needs_prompt(self) -> bool:
        """Whether the tail needs the prompt's ids: to score them, or to penalise their repetition."""
        return self.prompt_logprobs >= 0 or self.repetition_penalty != 1


class NewRequest(Wire, frozen=True):
    """A request's spec, sent in the descriptor of its first batch only."""

    request_id: int
    sampling: SamplingParams
    seed: int  # the resolved seed (a request without one gets a random seed at the head)
    generated: int = 0  # output tokens already sampled elsewhere (1 in the decode pool: the prefill pool's first)
    prompt: tuple[int, ...] = ()  # the prompt's ids, where the sampling needs them (``needs_prompt``)
    cached_tokens: int = 0  # prompt tokens the head found in the prefix cache (not computed)
    pooled_tokens: tuple[int, int, int] = (0, 0, 0)  # of those, read back from the KV pool: host, disk, remote
    queued_ns: int = 0  # from its arrival at the head to its first batch (a duration: the head's clock)
    decode_head: int = -1  # a prefill instance's request: the head of the decode instance its KV goes to
    output: tuple[int, ...] = ()  # the tokens output so far, where the sampling needs them (``needs_output``)


class Row(Wire, frozen=True):
    """One request's share of a packed batch: ``num_tokens`` tokens from ``start``.

    An emitting row may end with draft tokens (candidates for the request's next tokens,
    ``draft``, the row's last ``len(draft)`` tokens): the tail then samples after the
    request's newest token and after each draft, keeps each draft its sample confirms,
    and emits those samples up to the first that differs (1 to ``len(draft) + 1``
    tokens). Rejected drafts' K/V is stale: the head's next row for the request starts
    at the first rejected position and overwrites it.
    """

    request_id: int
    start: int  # position of the row's first token
    num_tokens: int
    new_blocks: tuple[int, ...]  # KV block ids added since the stage last saw the request
    emit: bool  # the row ends at the request's newest token (and its drafts): the tail samples
    draft: tuple[int, ...] = ()  # emitting rows: the candidate tokens ending the row

    @property
    def samples(self) -> int:
        """Positions the tail samples after: the last ``samples`` tokens of the row."""
        return 1 + len(self.draft) if self.emit else 0


class PoolLoad(Wire, frozen=True):
    """A request's prefix blocks to read back from the KV pool (kvasir/kvpool/): each stage
    reads its slice of each ``keys[i]`` into ``blocks[i]``, in order, up to the first it
    cannot, and tells the head how many it read (``PoolLoaded``)."""

    request_id: int
    blocks: tuple[int, ...]
    keys: tuple[BlockKey, ...]
    # (stage, peer): a stage of this ring that reads what its own host lacks from the stage
    # of the same layers on another host (global indexes; kvasir/wire/kvpool.py)
    peers: tuple[tuple[int, int], ...] = ()


class BatchDescriptor(Wire, frozen=True):
    """The composition of one physical batch, decided once by the head.

    A descriptor with no rows only carries releases and the KV pool's news (slot -1, no
    boundary). Every stage applies them in order before the rows: releases, then
    ``registered`` (blocks the head's prefix cache registered since its last descriptor:
    the stage notes which prefix each holds), ``spill`` (blocks it evicted: each stage
    copies its slice of (block, key) out for the KV pool before anything overwrites it),
    then ``load``.
    """

    batch_id: int
    slot: int  # boundary slot index on the edge it travels
    num_tokens: int
    rows: tuple[Row, ...]
    release: tuple[int, ...]  # requests whose KV every stage frees before running this batch
    new_requests: tuple[NewRequest, ...]
    scheduled_ns: int  # CLOCK_MONOTONIC time the head fixed the composition
    registered: tuple[tuple[int, BlockKey], ...] = ()  # (block, prefix key) the head's cache registered
    spill: tuple[tuple[int, BlockKey], ...] = ()  # and evicted
    load: tuple[PoolLoad, ...] = ()
    solo: bool = False  # fixed while no other batch was in flight: each stage may run it on its solo_threads


class SampledToken(Wire, frozen=True):
    request_id: int
    token_id: int
    index: int  # position in the request's output
    finish: FinishReason | None  # None while running
    queued_ns: int = 0  # on a request's first token: how long it waited at the head (a duration)
    cached_tokens: int = 0  # on a request's first token: prompt tokens found in the prefix cache
    pooled_tokens: tuple[int, int, int] = (0, 0, 0)  # and of those, read back from the KV pool: host, disk, remote
    logprob: float = (
        0.0  # with SamplingParams.logprobs >= 0: the token's log-probability (the model's, before sampling)
    )
    top: tuple[tuple[int, float], ...] = ()  # and the most likely tokens' (id, log-probability), best first
    passes: int = 0  # on a request's last token: its rows that emitted tokens (one pass of the model each)
    drafted: int = 0  # and the draft tokens checked for it (speculative decoding)
    accepted: int = 0  # and of those, the ones the model confirmed


class PromptScores(Wire, frozen=True):
    """The tail -> the bridge: log-probabilities of a run of a request's prompt tokens, each
    given the tokens before it (one prompt chunk's worth)."""

    request_id: int
    first: int  # position of the first scored token (>= 1: the first prompt token has no score)
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    top: tuple[tuple[tuple[int, float], ...], ...]  # per token, the most likely tokens' (id, log-probability)


class Credit(Wire, frozen=True):
    """A consumer hands a boundary slot back to its producer."""

    slot: int
