"""The head's inbox (``HeadMessage``): requests from the bridge, the tail's results and, in
a disaggregated plan, the KV hand-off between the pools' heads."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from kvasir.wire.base import Tagged
from kvasir.wire.batch import BLOCK_KEY_BYTES, SampledToken, SamplingParams


# -- the head's inbox ---------------------------------------------------------------------
class Enqueue(Tagged, frozen=True):
    request_id: int
    token_ids: tuple[int, ...]
    sampling: SamplingParams
    client: int = 0  # the bridge's number for the submitting client (fair admission across clients)
    cache_root: Annotated[bytes, msgspec.Meta(max_length=BLOCK_KEY_BYTES)] = (
        b""  # prefix-cache namespace (empty: shared)
    )
    decode_head: int = -1  # a disaggregated plan: the head of the decode instance it goes on to
    pooled: int = 0  # the prompt's first blocks the KV pool holds whole for this instance (the bridge's index)
    peers: tuple[tuple[int, int], ...] = ()  # (stage, peer): where a stage reads what its host lacks (PoolLoad)


class CancelRequest(Tagged, frozen=True):
    request_id: int


class BatchResult(Tagged, frozen=True):
    """What the tail sends back to the head for one batch: it closes the ring."""

    batch_id: int
    tokens: tuple[SampledToken, ...]


class Handoff(Tagged, frozen=True):
    """Prefill tail -> decode head: a request's prompt is done and its first token sampled
    (and not its last); its KV is on its way from the prefill stages to the decode stages."""

    request_id: int
    prompt_len: int
    first_token: int
    sampling: SamplingParams
    seed: int
    ready_ns: int  # when the prefill tail handed it over (the decode head restamps it on arrival: its own clock)
    prefill_head: int = 0  # the head of the prefill instance it comes from (its KV's stages follow)
    prompt: tuple[int, ...] = ()  # the prompt's ids where its sampling reads them (SamplingParams.needs_prompt)


class KvDrop(Tagged, frozen=True):
    """Prefill head -> decode head: a request whose prompt KV was announced to the decode
    stages ended in the prefill pool (finished at its first token, cancelled, failed, or
    its hand-off lease ran out); the decode stages forget its parts. The prefill side has
    told the bridge how it ended, so the decode head says nothing: a second word could
    overtake the first (the bridge's inbox is fair-queued across senders) and end the
    client's request as cancelled instead."""

    request_id: int


class KvHeld(Tagged, frozen=True):
    """Decode stage -> decode head: the stage holds its layers of a request's KV."""

    request_id: int
    stage: int  # global stage index
    nbytes: int  # KV bytes the stage copied
    copy_ns: int  # how long the copy took
    held_ns: int  # when it was done (CLOCK_MONOTONIC)


class KvPlaced(Tagged, frozen=True):
    """Decode head -> prefill head: the request has decode blocks and is being copied; the
    hand-off lease starts now (waiting for decode blocks is back-pressure, not a fault)."""

    request_id: int


class Adopted(Tagged, frozen=True):
    """Decode head -> prefill head: every decode stage holds the request's KV (or it was
    dropped); the prefill pool frees the request's blocks."""

    request_id: int


class Retire(Tagged, frozen=True):
    """Bridge -> head of an instance that is moving to another pool (nothing new is routed
    to it): say ``Retired`` once the head holds no request (kvasir/bridge/moves.py)."""

    index: int  # the head's global stage index (echoed in Retired)


PoolTier = Literal["host", "disk", "remote"]  # remote: read from another host's pool


class PoolLoaded(Tagged, frozen=True):
    """A stage -> its head: of a request's ``PoolLoad``, the blocks it read back, from
    the first (one tier per block, where each was found); it could not read the next."""

    request_id: int
    stage: int  # global stage index
    tiers: tuple[PoolTier, ...]


HeadMessage = (
    Enqueue | CancelRequest | BatchResult | Handoff | KvDrop | KvHeld | KvPlaced | Adopted | PoolLoaded | Retire
)
