"""The bridge's way into the instances: one socket to each admitting head (a colocated
instance's, or a prefill instance's), the conductor that picks one per request
(kvasir/bridge/conductor.py), and which instance each stage belongs to."""

from __future__ import annotations

import time
from collections.abc import Sequence

import zmq

from kvasir.bridge.conductor import Candidate, Choice, Conductor
from kvasir.config.fleet import Ring
from kvasir.config.plan import Plan
from kvasir.transport.channels import BatchedSocket
from kvasir.transport.fabric import Sockets


class Heads:
    def __init__(self, plan: Plan, sockets: Sockets) -> None:
        rings = plan.rings()
        self.sockets = sockets
        self.admitting: list[Ring[Plan]] = [ring for ring in rings if ring.pool != "decode"]
        self.decode: list[Ring[Plan]] = [ring for ring in rings if ring.pool == "decode"]
        self.instance_of = {index: ring.name for ring in rings for index in range(ring.first, ring.last + 1)}
        self.pool_of = {ring.name: ring.pool for ring in rings}
        self.conductor = Conductor(
            plan.route.policy,
            (Candidate(ring.name, ring.plan.kv.block_size, ring.plan.kv.num_blocks) for ring in self.admitting),
        )
        self._io: dict[str, tuple[zmq.Socket, BatchedSocket]] = {}
        for ring in self.admitting:
            self._io[ring.name] = self._connect(ring)

    def _connect(self, ring: Ring[Plan]) -> tuple[zmq.Socket, BatchedSocket]:
        # unbounded: accepted requests are bounded by bridge.max_waiting, and a send that
        # waited for a dead head would stall every client
        head = self.sockets.unbound(zmq.PUSH)
        head.setsockopt(zmq.SNDHWM, 0)
        self.sockets.attach(head, self.sockets.ends.stage_in(ring.first))
        return head, BatchedSocket(head)

    def pick(self, prompt: Sequence[int], root: bytes) -> Choice:
        """The instance for a request (RequestError "restarting" when none serves)."""
        return self.conductor.pick(prompt, root, time.monotonic())

    def decode_instance(self) -> str | None:
        """The decode instance a disaggregated plan's request goes on to (None: colocated)."""
        return self.decode[0].name if self.decode else None

    def send_now(self, instance: str, body: bytes) -> None:
        self._io[instance][1].send_now([body])

    async def send(self, instance: str, body: bytes) -> None:
        await self._io[instance][1].send(body)

    def down(self) -> None:
        """Every instance's ring failed: drop what was queued for the dead heads and
        route nothing until they serve again."""
        for ring in self.admitting:
            self.conductor.down(ring.name)
            head, _ = self._io[ring.name]
            head.close(linger=0)
            self._io[ring.name] = self._connect(ring)

    def up(self) -> None:
        for ring in self.admitting:
            self.conductor.up(ring.name)
