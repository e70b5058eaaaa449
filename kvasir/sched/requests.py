"""What the head's scheduler keeps of each request, and what it hands out: a batch to run
and the tokens (or cancellations) clients should see."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from kvasir.wire.batch import BatchDescriptor, NewRequest, SamplingParams


@dataclass
class RequestState:
    request_id: int
    prompt: list[int]  # [] in a decode pool, which holds the prompt's KV, not its tokens
    sampling: SamplingParams
    seed: int
    need_blocks: int
    prompt_len: int = -1  # len(prompt) unless given
    output: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    blocks_sent: int = 0
    computed: int = 0  # tokens whose K/V is written, or being written by an in-flight batch
    in_flight: bool = False
    announced: bool = False  # its NewRequest has travelled in a descriptor
    cancelled: bool = False
    parked: bool = False  # holds its blocks but is not scheduled (KV being handed between pools)
    client: int = 0  # the bridge's number for the client that submitted it
    arrival: int = 0  # admission order among waiting requests
    cache_root: bytes = b""  # the parent of its first block key: its prefix-cache namespace
    keys: list[bytes] | None = None  # chained keys of its full blocks, as far as known (prefix cache)
    registered: int = 0  # its first blocks that are in the prefix cache
    cached_tokens: int = 0  # prompt tokens it found cached instead of computing them
    arrived_ns: int = field(default_factory=time.monotonic_ns)  # when the head took it
    draft: list[int] = field(default_factory=list)  # proposed next tokens, for its next decode row
    drafted: int = 0  # drafts in its batch in flight (their K/V is kept only as far as confirmed)
    context: tuple[int, ...] = ()  # a decode pool's request: its prompt's ids where the sampling reads them
    pooled: int = 0  # its prompt's first blocks the KV pool holds for this instance (the bridge's word)
    loading: int = 0  # blocks its stages are reading back from the pool (it waits: not scheduled)
    pooled_tokens: tuple[int, int, int] = (0, 0, 0)  # of cached_tokens, read back from the pool: host, disk, remote
    peers: tuple[tuple[int, int], ...] = ()  # (stage, peer): where its stages read what their hosts lack

    def __post_init__(self) -> None:
        if self.prompt_len < 0:
            self.prompt_len = len(self.prompt)

    @property
    def length(self) -> int:
        return self.prompt_len + len(self.output)

    def tokens(self, start: int, count: int) -> list[int]:
        """Tokens [start, start + count) of prompt + output, without copying either whole."""
        split = self.prompt_len
        head = self.prompt[start : start + count]
        return head + self.output[max(0, start - split) : max(0, start + count - split)]

    def announcement(self, prompt: bool = False) -> NewRequest:
        """The request's spec for the tail, with its prompt and output so far where its
        sampling reads them (``prompt``: the prompt in any case, for a prefill pool's tail
        to hand to the decode pool's drafter)."""
        sampling = self.sampling
        return NewRequest(
            self.request_id,
            sampling,
            self.seed,
            len(self.output),
            tuple(self.prompt or self.context) if sampling.needs_prompt or prompt else (),
            self.cached_tokens,
            self.pooled_tokens,
            time.monotonic_ns() - self.arrived_ns,
            output=tuple(self.output) if sampling.needs_output else (),
        )

    def roll_back(self, confirmed: int) -> None:
        """Its batch is back: of its drafts, only the ``confirmed`` ones' K/V stands; the
        rest is stale on every stage, and the next row starts where it begins (so
        overwrites it). Blocks stay the request's (its whole reservation is its own)."""
        self.in_flight = False
        self.computed -= self.drafted - confirmed
        self.drafted = 0


@dataclass(frozen=True)
class Emitted:
    """A token (or a cancellation, token_id None) the head learned about a request."""

    request_id: int
    token_id: int | None
    index: int
    finish: str | None  # "stop" | "length" | "cancelled" | None


@dataclass(frozen=True)
class ScheduledBatch:
    descriptor: BatchDescriptor
    token_ids: torch.Tensor  # [T] the head's input
