"""The in-process chain: every stage in one process, driven the way the ring drives them.

The head's scheduler fills up to ``inflight`` batches, each batch passes the stages in
order, the tail samples, and the sampled tokens go back to the scheduler, which closes
the loop. The ring daemon runs the same pieces, one stage per process.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvasir.config.plan import Plan, check_model_fit
from kvasir.model.source import ModelSource
from kvasir.sched.scheduler import Emitted, ScheduledBatch, Scheduler
from kvasir.stage.drafting import model_drafter
from kvasir.stage.engine import StageEngine, in_process_shards
from kvasir.stage.sampling import Sampler
from kvasir.wire.batch import BatchDescriptor, SamplingParams


@dataclass
class Completion:
    """A request's output as the chain saw it end."""

    request_id: int
    token_ids: list[int] = field(default_factory=list)
    finish: str | None = None


class Chain:
    """``trace``, if given, sees every batch descriptor as the head fixes it."""

    def __init__(
        self,
        plan: Plan,
        source: ModelSource,
        trace: Callable[[BatchDescriptor], None] | None = None,
    ) -> None:
        check_model_fit(plan, source.num_layers, source.max_positions, source.num_experts, source.moe_layers)
        self.plan = plan
        self._trace = trace
        self.stages = [StageEngine(plan, index, source) for index in range(len(plan.stages))]
        for index, stage in enumerate(self.stages):
            if plan.stages[index].experts:  # its expert shards, in this process too
                stage.attach(in_process_shards(plan, index, source, stage.device))
        self.scheduler = Scheduler(plan, source.vocab_size, drafter=model_drafter(plan, self.stages[0].device))
        self.sampler = Sampler(source.eos_token_ids, plan.model.max_seq_len, speculative=plan.speculative is not None)
        self._queue: deque[ScheduledBatch] = deque()

    def submit(self, prompt: list[int], sampling: SamplingParams | None = None) -> int:
        return self.scheduler.submit(prompt, sampling if sampling is not None else SamplingParams())

    def cancel(self, request_id: int) -> Emitted | None:
        return self.scheduler.cancel(request_id)

    @property
    def idle(self) -> bool:
        return self.scheduler.idle and not self._queue

    def forward(self, batch: ScheduledBatch) -> torch.Tensor:
        """Pass one batch through every stage; the tail's logits [emitting rows, vocab]."""
        data = batch.token_ids
        for stage in self.stages:
            data = stage.run(batch.descriptor, data)
        return data

    def step(self) -> list[Emitted]:
        """Fill the ring, then run its oldest batch to the end and close the loop."""
        while (batch := self.scheduler.next_batch()) is not None:
            if self._trace is not None:
                self._trace(batch.descriptor)
            self._queue.append(batch)
        if not self._queue:
            return []
        batch = self._queue.popleft()
        result = self.sampler.sample(batch.descriptor, self.forward(batch))
        return self.scheduler.complete(result)

    def run(self, done: dict[int, Completion] | None = None, max_steps: int = 1_000_000) -> dict[int, Completion]:
        """Step until every submitted request has ended, folding outputs into ``done``."""
        done = {} if done is None else done
        for _ in range(max_steps):
            if self.idle:
                return done
            for event in self.step():
                record(done, event)
        raise RuntimeError(f"chain still busy after {max_steps} steps")


def record(outputs: dict[int, Completion], event: Emitted) -> None:
    """Fold one emitted event into the per-request outputs."""
    completion = outputs.setdefault(event.request_id, Completion(event.request_id))
    if event.token_id is not None:
        completion.token_ids.append(event.token_id)
    completion.finish = event.finish
