"""Stages to the bridge (``BridgeMessage``): sampled tokens, ended requests and statistics
(kvasir/wire/stats.py)."""

from __future__ import annotations

from typing import Annotated

import msgspec

from kvasir.wire.base import Tagged
from kvasir.wire.batch import PromptScores, SampledToken
from kvasir.wire.head import BLOCK_KEY_BYTES, PoolTier
from kvasir.wire.stats import ShardStats, StageStats


# -- stages to the bridge -----------------------------------------------------------------
class TokenEvents(Tagged, frozen=True):
    tokens: tuple[SampledToken, ...]
    prompt: tuple[PromptScores, ...] = ()  # prompt chunks scored in the same batch (before its tokens)


class RequestEnded(Tagged, frozen=True):
    """The head ended a request without a token: cancelled, or refused (code + message)."""

    request_id: int
    code: str  # "cancelled" or an error code
    message: str = ""


class Retired(Tagged, frozen=True):
    """A moving instance's head holds no request any more (its answer to ``Retire``)."""

    index: int  # the head's global stage index
    pid: int


class HandoffReport(Tagged, frozen=True):
    """Decode head -> bridge: one request's KV hand-off, measured."""

    request_id: int
    nbytes: int  # KV bytes moved, all decode stages together
    seconds: float  # from the prefill tail handing the request over to the last decode stage's copy
    copy_s: float  # the slowest decode stage's copy (they copy in parallel)


MAX_PREFIX_EVENTS = 1 << 20  # keys in one PrefixEvents message (a snapshot is cut to this many)
PrefixKeys = Annotated[
    tuple[Annotated[bytes, msgspec.Meta(max_length=BLOCK_KEY_BYTES)], ...], msgspec.Meta(max_length=MAX_PREFIX_EVENTS)
]


class PrefixEvents(Tagged, frozen=True):
    """A head -> the bridge: prefix blocks its cache registered and evicted since its last
    events (``reset``: ``stored`` is all it holds now), for the conductor's index."""

    head: int  # the head's global stage index
    pid: int
    stored: PrefixKeys = ()
    removed: PrefixKeys = ()
    reset: bool = False


class PoolEvents(Tagged, frozen=True):
    """A stage -> the bridge: its slices of prefix blocks one of its KV pool tiers stored
    and removed since its last events (``reset``: ``stored`` is all the tier holds now,
    its first events after a start), for the conductor's index of the pool."""

    stage: int  # global stage index
    pid: int
    tier: PoolTier
    stored: PrefixKeys = ()
    removed: PrefixKeys = ()
    reset: bool = False


BridgeMessage = (
    TokenEvents | RequestEnded | StageStats | ShardStats | HandoffReport | PrefixEvents | PoolEvents | Retired
)
