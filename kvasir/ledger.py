"""The bridge's book of requests: accepted and not yet ended, counted per client."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from kvasir.detokenizer import IncrementalDetokenizer
from kvasir.messages import Finished, Timings, Usage
from kvasir.transport import BatchedSocket


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
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    scheduled_ns: int = 0
    first_ns: int = 0
    last_ns: int = 0

    def finished(self, rid: int, reason: str) -> Finished:
        n = len(self.token_ids)
        return Finished(
            request_id=rid,
            reason=reason,
            token_ids=self.token_ids,
            usage=Usage(prompt_tokens=self.prompt_tokens, completion_tokens=n),
            timings=Timings(
                queued_s=max(0, self.scheduled_ns - self.submitted_ns) / 1e9,
                first_token_s=(self.first_ns - self.submitted_ns) / 1e9,
                per_token_s=(self.last_ns - self.first_ns) / 1e9 / (n - 1) if n > 1 else 0.0,
                total_s=(self.last_ns - self.submitted_ns) / 1e9,
            ),
        )


class Ledger:
    """Requests in the daemon by id, and how many each client has."""

    def __init__(self) -> None:
        self._by_id: dict[int, Pending] = {}
        self._per_client: dict[Peer, int] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def get(self, rid: int) -> Pending | None:
        return self._by_id.get(rid)

    def held_by(self, peer: Peer) -> int:
        return self._per_client.get(peer, 0)

    def of(self, peer: Peer) -> list[int]:
        """The ids of one client's requests (a scan: only for a client that is gone)."""
        return [rid for rid, record in self._by_id.items() if record.peer == peer] if peer in self._per_client else []

    def add(self, rid: int, record: Pending) -> None:
        self._by_id[rid] = record
        self._per_client[record.peer] = self._per_client.get(record.peer, 0) + 1

    def end(self, rid: int) -> Pending | None:
        """Forget an ended request; its record, or None when it had already ended."""
        record = self._by_id.pop(rid, None)
        if record is not None:
            left = self._per_client[record.peer] - 1
            if left:
                self._per_client[record.peer] = left
            else:
                del self._per_client[record.peer]
        return record

    def end_all(self) -> list[tuple[int, Pending]]:
        """Forget every request; what they were."""
        ended = list(self._by_id.items())
        self._by_id.clear()
        self._per_client.clear()
        return ended
