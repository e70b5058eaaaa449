"""A stage's place (its index in its pool's ring, its global index) and its sockets.

Each socket is made once per endpoint and kept: a moving instance's stages build their
pool's parts again (kvasir/stage/roles.py) on the sockets they already have, so a bound
endpoint is never unbound and bound again while its peers are connected to it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from kvasir.errors import KvasirError
from kvasir.logs import Logger
from kvasir.transport.channels import Endpoints, PullChannel, PushChannel
from kvasir.transport.fabric import Sockets
from kvasir.wire.control import HandoffWiring, StageSettings


@dataclass
class Wiring:
    """A stage's settings in the pool it serves now, and its sockets' context."""

    settings: StageSettings
    sockets: Sockets
    log: Logger
    made: dict[tuple, Any] = field(default_factory=dict)  # (how, kind, endpoint) -> its socket or channel

    @property
    def ends(self) -> Endpoints:
        return self.sockets.ends

    @property
    def local(self) -> int:
        return self.settings.index - self.settings.first

    @property
    def last(self) -> int:
        return len(self.settings.plan.stages) - 1

    @property
    def head(self) -> int:
        return self.settings.first

    @property
    def handoff(self) -> HandoffWiring:
        """A pool's hand-off wiring (the launcher gives it to every stage of a disaggregated plan)."""
        if self.settings.handoff is None:
            raise KvasirError(f"stage {self.settings.index} of the {self.settings.pool} pool has no hand-off wiring")
        return self.settings.handoff

    def others(self, heads: list[int]) -> list[int]:
        """Of ``heads``, the other instances' (a movable instance is in both pools' lists)."""
        return [head for head in heads if head != self.head]

    def push(self, kind, endpoint: str) -> PushChannel:
        return self._once(("push", kind, endpoint), lambda: PushChannel[kind](self.sockets.connect(zmq.PUSH, endpoint)))

    def pull(self, kind, endpoint: str) -> PullChannel:
        return self._once(
            ("pull", kind, endpoint), lambda: PullChannel[kind](self.sockets.bind(zmq.PULL, endpoint), kind, self.log)
        )

    def connect(self, kind: int, endpoint: str) -> Any:
        """A plain socket connected to ``endpoint`` (a KV stream's, another host's)."""
        return self._once(("connect", kind, endpoint), lambda: self.sockets.connect(kind, endpoint))

    def bind(self, kind: int, endpoint: str) -> Any:
        return self._once(("bind", kind, endpoint), lambda: self.sockets.bind(kind, endpoint))

    def _once(self, key: tuple, make: Callable[[], Any]) -> Any:
        if key not in self.made:
            self.made[key] = make()
        return self.made[key]
