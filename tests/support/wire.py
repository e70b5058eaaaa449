"""Reading raw replies on the client edge in tests that speak ZeroMQ themselves."""

from __future__ import annotations

from kvasir.transport import envelopes


def events(decoder, body: bytes) -> list:
    """The events of one reply body: one, or a batch of them (kvasir/transport/envelopes.py)."""
    return [decoder.decode(member) for member in envelopes.members(body)]
