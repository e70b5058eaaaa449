"""The bridge's book of requests: accepted and not yet ended, counted per client."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from kvasir.bridge.conductor import Choice
from kvasir.bridge.detokenizer import IncrementalDetokenizer, StreamDetokenizer
from kvasir.transport.channels import BatchedSocket
from kvasir.units import gib_per_s
from kvasir.wire.base import FinishReason
from kvasir.wire.batch import SampledToken
from kvasir.wire.client import Drafts, Finished, HandoffSummary, HandoffTimings, Timings, Usage

RECENT_HANDOFFS = 4096  # hand-offs the percentiles are taken over


class Peer(NamedTuple):
    """A client: the socket it came in on (local ipc, or remote TCP) and its ZMQ identity."""

    io: BatchedSocket
    identity: bytes


@dataclass
class Pending:
    """A request the bridge has accepted and not yet ended."""

    peer: Peer
    key: int
    prompt_tokens: int
    submitted_ns: int
    detokenizer: IncrementalDetokenizer | StreamDetokenizer | None
    logprobs: bool = False  # its tokens go out with their log-probabilities
    token_ids: list[int] = field(default_factory=list)
    enqueued_ns: int = 0  # when the bridge handed it to the head (the bridge's clock)
    queued_ns: int = 0  # then how long it waited at the head (the head's clock: a duration)
    cached_tokens: int = 0  # of prompt_tokens, found in the head's prefix cache
    pooled_tokens: tuple[int, int, int] = (0, 0, 0)  # of those, read back from the KV pool: host, disk, remote
    first_ns: int = 0
    second_ns: int = 0
    last_ns: int = 0
    handoff: HandoffTimings | None = None
    early: dict[int, SampledToken] = field(default_factory=dict)  # tokens that overtook an earlier one
    instance: str = ""  # the instance the conductor sent it to
    decode: str | None = None  # a disaggregated plan: the decode instance it goes on to
    route: str = ""  # why
    backlog: int = 0  # prompt tokens it adds to its instance's backlog until its first token

    def routed(self, choice: Choice, decode: str | None) -> None:
        self.instance, self.route, self.backlog, self.decode = choice.name, choice.reason, choice.backlog, decode

    def in_order(self, token: SampledToken) -> list[SampledToken]:
        """The tokens to stream now, in output order. In a disaggregated plan the first
        token comes from the prefill pool's tail and the rest from the decode pool's, on
        different sockets: a later one may arrive first and waits here."""
        if token.index != len(self.token_ids):
            self.early[token.index] = token
            return []
        ready = [token]
        while len(self.token_ids) + len(ready) in self.early:
            ready.append(self.early.pop(len(self.token_ids) + len(ready)))
        return ready

    def finished(self, rid: int, reason: FinishReason, last: SampledToken | None = None) -> Finished:
        """Its terminal event; ``last``: its last token, which carries the tail's counts of passes and drafts."""
        n = len(self.token_ids)
        return Finished(
            request_id=rid,
            reason=reason,
            token_ids=self.token_ids,
            usage=Usage(
                prompt_tokens=self.prompt_tokens,
                completion_tokens=n,
                cached_tokens=self.cached_tokens,
                cached_host_tokens=self.pooled_tokens[0],
                cached_disk_tokens=self.pooled_tokens[1],
                cached_remote_tokens=self.pooled_tokens[2],
            ),
            timings=Timings(
                queued_s=(max(0, self.enqueued_ns - self.submitted_ns) + self.queued_ns) / 1e9,
                first_token_s=(self.first_ns - self.submitted_ns) / 1e9,
                per_token_s=(self.last_ns - self.first_ns) / 1e9 / (n - 1) if n > 1 else 0.0,
                total_s=(self.last_ns - self.submitted_ns) / 1e9,
                second_token_s=(self.second_ns - self.first_ns) / 1e9 if n > 1 else None,
            ),
            handoff=self.handoff,
            instances=[self.instance] + ([self.decode] if self.decode is not None and n > 1 else []),
            route=self.route,
            drafts=Drafts.of(n, last.passes, last.drafted, last.accepted) if last is not None else None,
        )


class Ledger:
    """Requests in the daemon by id, and how many each client has.

    A client with requests in the daemon has a number (the head's fair admission tells
    clients apart by it); it is given with the client's first request and forgotten with
    its last, so clients that come and go leave nothing behind.
    """

    def __init__(
        self, ended: Callable[[Pending], None] = lambda _: None, started: Callable[[Pending], None] = lambda _: None
    ) -> None:
        """``ended``: told of every request the ledger forgets; ``started``: of each first
        token (the conductor's load)."""
        self._ended, self._started = ended, started
        self._by_id: dict[int, Pending] = {}
        self._per_client: dict[Peer, int] = {}
        self._numbers: dict[Peer, int] = {}
        self._next_number = 1

    def __len__(self) -> int:
        return len(self._by_id)

    def items(self) -> list[tuple[int, Pending]]:
        return list(self._by_id.items())

    def get(self, rid: int) -> Pending | None:
        return self._by_id.get(rid)

    def held_by(self, peer: Peer) -> int:
        return self._per_client.get(peer, 0)

    def of(self, peer: Peer) -> list[int]:
        """The ids of one client's requests (a scan: only for a client that is gone)."""
        return [rid for rid, record in self._by_id.items() if record.peer == peer] if peer in self._per_client else []

    def number(self, peer: Peer) -> int:
        """The client's number, given now if it has no request in the daemon yet."""
        number = self._numbers.get(peer)
        if number is None:
            number = self._numbers[peer] = self._next_number
            self._next_number += 1
        return number

    def add(self, rid: int, record: Pending) -> None:
        self.number(record.peer)
        self._by_id[rid] = record
        self._per_client[record.peer] = self._per_client.get(record.peer, 0) + 1

    def first_token(self, record: Pending) -> None:
        """A request's first token came: its prompt leaves its instance's backlog."""
        self._started(record)
        record.backlog = 0

    def end(self, rid: int) -> Pending | None:
        """Forget an ended request; its record, or None when it had already ended."""
        record = self._by_id.pop(rid, None)
        if record is not None:
            self._ended(record)
            left = self._per_client[record.peer] - 1
            if left:
                self._per_client[record.peer] = left
            else:
                del self._per_client[record.peer]
                self._numbers.pop(record.peer, None)
        return record

    def end_all(self) -> list[tuple[int, Pending]]:
        """Forget every request; what they were."""
        ended = list(self._by_id.items())
        for _, record in ended:
            self._ended(record)
        self._by_id.clear()
        self._per_client.clear()
        self._numbers.clear()
        return ended


class HandoffLog:
    """KV hand-offs between pools since start: totals, and the recent ones for percentiles."""

    def __init__(self) -> None:
        self.count = 0
        self.kv_bytes = 0
        self.seconds = 0.0
        self.recent: deque[tuple[int, float, float]] = deque(maxlen=RECENT_HANDOFFS)  # (bytes, seconds, copy seconds)

    def add(self, nbytes: int, seconds: float, copy_s: float) -> HandoffTimings:
        self.count += 1
        self.kv_bytes += nbytes
        self.seconds += seconds
        self.recent.append((nbytes, seconds, copy_s))
        return HandoffTimings(kv_bytes=nbytes, seconds=seconds, copy_s=copy_s, gibps=gib_per_s(nbytes, copy_s))

    def summary(self) -> HandoffSummary | None:
        if not self.count:
            return None
        times = sorted(seconds for _, seconds, _ in self.recent)
        copying = sum(copy_s for _, _, copy_s in self.recent)
        moved = sum(nbytes for nbytes, _, _ in self.recent)
        return HandoffSummary(
            count=self.count,
            kv_bytes=self.kv_bytes,
            p50_s=times[len(times) // 2],
            p99_s=times[min(len(times) - 1, int(len(times) * 0.99))],
            gibps=gib_per_s(moved, copying),
            seconds=self.seconds,
        )
