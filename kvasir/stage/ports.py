"""The interfaces a stage agent's loop is built from: where its batches come from (an
intake), where its outputs go (an outlet) and its part in the KV hand-off between pools."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import zmq

from kvasir.errors import KvasirError
from kvasir.stage.heads import Work
from kvasir.wire.batch import BatchDescriptor
from kvasir.wire.control import StageSettings
from kvasir.wire.stats import DraftCounters, HandoffCounters, HeadQueue, PoolCounters, PrefixCounters


class Intake(Protocol):
    """Where a stage's batches come from."""

    sockets: list[zmq.Socket]

    def receive(self) -> None: ...

    def take(self, room: bool) -> Work | None: ...

    def consumed(self, descriptor: BatchDescriptor) -> None: ...

    def queue(self) -> HeadQueue | None: ...  # a head's queue and batches in flight

    def prefix(self) -> PrefixCounters | None: ...  # a head's prefix cache

    def drafts(self) -> DraftCounters | None: ...  # a head's speculative decoding

    def prefix_events(self) -> tuple[list[bytes], list[bytes], bool] | None:
        """A head: the prefix blocks registered and evicted since the last call (stored,
        removed, reset: stored is a snapshot), for the bridge's conductor."""
        ...

    hop_ns: int  # time spent on boundary hand-offs (reading slots, descriptors, credits)


class HandoffRole(Protocol):
    """What a stage does for the KV hand-off between pools (nothing in a colocated plan)."""

    sockets: list[zmq.Socket]

    def receive(self) -> float: ...  # seconds of work done

    def counters(self) -> HandoffCounters | None: ...  # a decode stage's KV received

    def after(self, descriptor: BatchDescriptor) -> None: ...

    def close(self) -> None: ...


class Outlet(Protocol):
    """Where a stage's outputs go."""

    sockets: list[zmq.Socket]

    @property
    def room(self) -> bool: ...

    @property
    def pending(self) -> bool: ...

    def receive(self) -> None: ...

    def emit(self, descriptor: BatchDescriptor, output: torch.Tensor | None) -> None: ...

    def scored(self, descriptor: BatchDescriptor) -> tuple[int, ...]:
        """The requests whose rows need logits at every token (a tail scoring prompts)."""
        ...

    def drafts(self) -> DraftCounters | None: ...  # a tail's verdicts on drafts

    hop_ns: int  # time spent on boundary hand-offs (writing slots, descriptors, credits)


class PoolPart(Protocol):
    """What a stage does for the KV pool (nothing in a plan without [kv_pool])."""

    def before(self, descriptor: BatchDescriptor) -> float: ...  # spills and loads; seconds taken

    def events(self) -> None: ...  # its tiers' changes, to the bridge

    def counters(self) -> PoolCounters | None: ...

    def close(self) -> None: ...


@dataclass
class PoolParts:
    """A stage's parts in the pool it serves now (kvasir/stage/roles.py): its settings
    there, its intake, its outlet and its hand-off role."""

    settings: StageSettings
    intake: Intake
    outlet: Outlet
    handoff: HandoffRole


class RegroupError(KvasirError):
    """A regroup command a stage cannot follow (it is dropped; the stage serves on as it was)."""
