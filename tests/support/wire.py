"""Reading raw replies on the client edge in tests that speak ZeroMQ themselves."""

from __future__ import annotations

from kvasir.wire import batching


def events(decoder, body: bytes) -> list:
    """The events of one reply body: one, or a batch of them (kvasir/wire/batching.py)."""
    return [decoder.decode(member) for member in batching.members(body)]
