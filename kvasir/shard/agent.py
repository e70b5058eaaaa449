"""The expert shard's loop: take a stage's dispatch, compute its rows' partial sums with
this shard's experts, write them back into the slot and say so.

Every dispatch is checked before it touches the slot (its layer is one of the stage's MoE
layers, its row count fits the slot, its expert ids are the model's); a bad one is
dropped and logged, and the stage, which then hears nothing, fails after its wait bound.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import msgspec
import torch
import zmq

from kvasir.model.moe import LocalExperts
from kvasir.ring.expert_slots import DispatchSegment
from kvasir.ring.shm import SlotError
from kvasir.ring.tcp_slots import EdgeError
from kvasir.transport.channels import PullChannel, PushChannel
from kvasir.wire.control import Heartbeat, ShardSettings
from kvasir.wire.experts import ExpertDone, ExpertWork
from kvasir.wire.stats import ShardStats

POLL_MS = 50


@dataclass
class ShardClock:
    started: float
    busy_s: float = 0.0
    starved_s: float = 0.0
    dispatches: int = 0


@dataclass
class ShardPorts:
    work: PullChannel  # ExpertMessage from the stage
    results: PushChannel  # ExpertMessage to the stage
    commands: PullChannel
    bridge: PushChannel
    control: PushChannel


class ShardAgent:
    def __init__(
        self,
        settings: ShardSettings,
        bank: dict[int, LocalExperts],
        slot: DispatchSegment,
        ports: ShardPorts,
        *,
        weights_dtype: torch.dtype,
        log,
    ) -> None:
        self.settings = settings
        self.wiring = settings.wiring  # its stage, experts and slot
        self.bank = bank
        self.slot = slot
        self.ports = ports
        self.weights_dtype = weights_dtype
        self.log = log
        self.device = next(iter(bank.values())).gate_up.device
        self.num_experts = next(iter(bank.values())).layout.num_experts
        self.clock = ShardClock(started=time.monotonic())
        self.heartbeat = Heartbeat("shard", self.wiring.number, os.getpid())
        self.poller = zmq.Poller()
        for sock in (ports.work.socket, ports.commands.socket):
            self.poller.register(sock, zmq.POLLIN)
        self._stopping = False
        self._next_report = 0.0

    def serve(self) -> None:
        while not self._stopping:
            for command in self.ports.commands.drain():
                if command.kind == "stop":
                    self._stopping = True
                elif command.kind == "regroup" and command.pool is not None:  # its stage's instance moved
                    self.settings = msgspec.structs.replace(self.settings, pool=command.pool)
            work = self.ports.work.drain_framed()
            for message, frames in work:
                self._handle(message, frames)
            if not work:
                self._wait()
            self._report()

    def _wait(self) -> None:
        started = time.monotonic()
        self.poller.poll(POLL_MS)
        self.clock.starved_s += time.monotonic() - started
        if os.getppid() != self.settings.launcher_pid:
            self.log.warning("launcher is gone; stopping")
            self._stopping = True

    def _handle(self, message, frames: list) -> None:
        if not isinstance(message, ExpertWork):
            self.ports.work.drop(f"{type(message).__name__} is not work for a shard")
            return
        problem = self._check(message, frames)
        if problem is not None:
            self.ports.work.drop(f"dispatch {message.seq}: {problem}")
            return
        started = time.monotonic()
        rows = message.rows
        hidden, ids, weights = self.slot.read_rows(rows, self.device, self.weights_dtype)
        with torch.inference_mode():
            out = self.bank[message.layer](hidden, ids, weights)
        self.slot.write_out(out)
        frames = [self.slot.out_frame(rows)] if self.slot.spec.kind == "tcp" else []
        self.ports.results.send(ExpertDone(message.seq, self.wiring.number, rows), frames)
        self.clock.busy_s += time.monotonic() - started
        self.clock.dispatches += 1

    def _check(self, work: ExpertWork, frames: list) -> str | None:
        """What is wrong with a dispatch, if anything (before it touches the slot). From a
        stage on another host the rows come as frames: frames that do not fit fail the
        shard (EdgeError), as a malformed frame on any network edge does."""
        if work.layer not in self.bank:
            return f"layer {work.layer} is not an MoE layer of stage {self.wiring.stage}"
        try:
            self.slot.check(work.rows)
        except SlotError as exc:
            return str(exc)
        if self.slot.spec.kind == "tcp":
            try:
                self.slot.fill_rows(work.rows, [frame.buffer for frame in frames])
            except SlotError as exc:
                raise EdgeError(f"dispatch {work.seq}: {exc}") from None
        elif frames:
            return "frames sent with a dispatch through shared memory"
        low, high = self.slot.ids[: work.rows].aminmax()
        if int(low) < 0 or int(high) >= self.num_experts:
            return f"expert ids outside [0, {self.num_experts})"
        return None

    def _report(self) -> None:
        now = time.monotonic()
        if now < self._next_report and not self._stopping:
            return
        self._next_report = now + self.settings.stats_interval_s
        self.ports.bridge.send(self.stats(now))
        self.ports.control.send(self.heartbeat)

    def stats(self, now: float) -> ShardStats:
        c = self.clock
        counts = tuple(sum(column) for column in zip(*(experts.routed for experts in self.bank.values())))
        return ShardStats(
            number=self.wiring.number,
            stage=self.wiring.stage,
            experts=self.wiring.experts,
            pid=os.getpid(),
            host=self.settings.fabric.host if self.settings.fabric is not None else "",
            wall_s=now - c.started,
            busy_s=c.busy_s,
            starved_s=c.starved_s,
            blocked_s=0.0,
            dispatches=c.dispatches,
            tokens=sum(counts),
            expert_tokens=counts,
            pool=self.settings.pool,
        )
