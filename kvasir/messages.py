"""Every wire type Kvasir exchanges, as msgspec Structs.

The batch descriptor is decided once by the head and travels unchanged to every stage;
each message carries only what its receiver lacks (a request's sampling spec on its
first appearance, a row's KV blocks as growth since the stage last saw the request).
Tensors never travel inside these bodies.
"""

from __future__ import annotations

import msgspec


class _Wire(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    pass


class SamplingParams(_Wire):
    """How the tail picks tokens for one request and when it stops."""

    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # 1 = no nucleus filtering
    top_k: int = 0  # 0 = no top-k filtering
    seed: int | None = None  # same seed, same output
    max_tokens: int = 128  # output tokens at most
    stop_token_ids: tuple[int, ...] = ()


class NewRequest(_Wire):
    """A request's spec, sent in the descriptor of its first batch only."""

    request_id: int
    sampling: SamplingParams
    seed: int  # the resolved seed (a request without one gets a random seed at the head)


class Row(_Wire):
    """One request's share of a packed batch: ``num_tokens`` tokens from ``start``."""

    request_id: int
    start: int  # position of the row's first token
    num_tokens: int
    new_blocks: tuple[int, ...]  # KV block ids added since the stage last saw the request
    emit: bool  # the row ends at the request's newest token: the tail samples after it


class BatchDescriptor(_Wire):
    """The composition of one physical batch, decided once by the head."""

    batch_id: int
    slot: int  # boundary slot index on the edge it travels
    num_tokens: int
    rows: tuple[Row, ...]
    release: tuple[int, ...]  # requests whose KV every stage frees before running this batch
    new_requests: tuple[NewRequest, ...]
    scheduled_ns: int  # CLOCK_MONOTONIC time the head fixed the composition


class SampledToken(_Wire):
    request_id: int
    token_id: int
    finish: str | None  # None while running, else "stop" | "length"


class BatchResult(_Wire):
    """What the tail sends back to the head for one batch: it closes the ring."""

    batch_id: int
    tokens: tuple[SampledToken, ...]
