"""The bridge's outgoing half: the tail's sampled tokens and prompt scores turned into each
request's events (text deltas in order, one ``Finished``), delivered to its client and
republished to ``kvasir tail`` subscribers."""

from __future__ import annotations

import time

import msgspec

from kvasir.bridge.ledger import Ledger, Pending
from kvasir.bridge.metrics import Metrics
from kvasir.bridge.outbox import Outbox
from kvasir.bridge.planner import Samples
from kvasir.transport.channels import BatchedSocket
from kvasir.wire.batch import PromptScores, SampledToken
from kvasir.wire.client import PromptLogprobs, TokenOut


class Streams:
    def __init__(
        self,
        requests: Ledger,
        metrics: Metrics,
        outbox: Outbox,
        publisher: BatchedSocket,
        encoder: msgspec.msgpack.Encoder,
        samples: Samples | None = None,
    ) -> None:
        """``samples``: the planner's (a plan with it enabled), fed each first token's and
        each gap's latency."""
        self.requests = requests
        self.samples = samples
        self.metrics = metrics
        self.outbox = outbox
        self.publisher = publisher
        self.encoder = encoder

    def prompt_scores(self, scores: PromptScores) -> None:
        record = self.requests.get(scores.request_id)
        if record is not None:
            top = [list(pairs) for pairs in scores.top]
            event = PromptLogprobs(
                request_id=scores.request_id,
                first=scores.first,
                token_ids=list(scores.token_ids),
                logprobs=list(scores.logprobs),
                top_logprobs=top,
            )
            self.outbox.deliver(record.peer, self.encoder.encode(event))

    async def token(self, arrived: SampledToken) -> None:
        record = self.requests.get(arrived.request_id)
        if record is None:
            return
        for token in record.in_order(arrived):
            await self._stream(record, token)

    async def _stream(self, record: Pending, token: SampledToken) -> None:
        now = time.monotonic_ns()
        gap_ns = now - record.last_ns if record.token_ids else None
        self.metrics.token(gap_ns)
        if self.samples is not None:
            if gap_ns is not None:
                self.samples.gap(gap_ns / 1e9)
            else:
                self.samples.first_token((now - record.submitted_ns) / 1e9)
        if not record.token_ids:
            record.first_ns = now
            record.queued_ns = max(token.queued_ns, 0)
            record.cached_tokens = cached = min(max(token.cached_tokens, 0), record.prompt_tokens)
            host, disk, remote = (max(n, 0) for n in token.pooled_tokens)
            host = min(host, cached)
            disk = min(disk, cached - host)
            record.pooled_tokens = (host, disk, min(remote, cached - host - disk))
            self.requests.first_token(record)  # its figures set: the conductor and the pool learn from them
        elif len(record.token_ids) == 1:
            record.second_ns = now
        record.last_ns = now
        record.token_ids.append(token.token_id)
        text = ""
        if record.detokenizer is not None:
            text = record.detokenizer.push(token.token_id)
            if token.finish is not None:
                text += record.detokenizer.flush()
        event = TokenOut(
            request_id=token.request_id,
            index=token.index,
            token_id=token.token_id,
            text=text,
            logprob=token.logprob if record.logprobs else None,
            top_logprobs=list(token.top) if record.logprobs else None,
        )
        encoded = self.encoder.encode(event)
        await self.publisher.send(encoded)
        self.outbox.deliver(record.peer, encoded)
        if token.finish is not None:
            self.requests.end(token.request_id)
            finished = record.finished(token.request_id, token.finish, token)
            self.metrics.finished(
                token.finish, finished.timings, finished.usage.prompt_tokens, finished.usage.completion_tokens
            )
            self.outbox.deliver(record.peer, self.encoder.encode(finished))
