"""In-memory stand-ins for the PUSH/PULL channels a head talks through, for unit tests of
its states: what was sent is kept in order, what is queued comes out of ``drain``."""

from __future__ import annotations


class FakeChannel:
    """Both ends of one channel: ``send`` appends to ``sent``; ``queue`` then ``drain``
    feed a receiver; ``drop`` counts what the receiver refused, as PullChannel does."""

    def __init__(self) -> None:
        self.socket = None  # nothing to poll: the test calls the receiver itself
        self.sent: list = []
        self.queued: list = []
        self.dropped: list[str] = []

    def send(self, message) -> None:
        self.sent.append(message)

    def queue(self, *messages) -> None:
        self.queued.extend(messages)

    def drain(self) -> list:
        out, self.queued = self.queued, []
        return out

    def drop(self, why: str) -> None:
        self.dropped.append(why)

    def take(self) -> list:
        """What was sent since the last take."""
        out, self.sent = self.sent, []
        return out
