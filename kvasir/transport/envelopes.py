"""Many client messages, or many events for one client, in one ZeroMQ message.

A body on the client edge is either one message (a msgpack map: a tagged struct) or a
msgpack array of at most ``MAX_BATCH`` such messages, each decoded and answered on its
own: one malformed member gets its own error and the rest are served. Both ends send
arrays when they have several messages ready at once (a client submitting in a loop,
the bridge answering a burst), which spares ZeroMQ and asyncio a round of work per
message; one message alone still travels as a plain map.
"""

from __future__ import annotations

import msgspec

from kvasir.wire.decoding import Decoder, Malformed

MAX_BATCH = 1024  # messages in one body


class BatchError(ValueError):
    """A body that is an array but not a usable batch."""


_ARRAY_MARKERS = frozenset({0xDC, 0xDD, *range(0x90, 0xA0)})  # msgpack array16, array32, fixarray
_splitter: Decoder[list[msgspec.Raw]] = Decoder(list[msgspec.Raw])
_joiner = msgspec.msgpack.Encoder()


def is_batch(body: bytes) -> bool:
    return bool(body) and body[0] in _ARRAY_MARKERS


def split(body: bytes) -> list[bytes]:
    """The members of a batch body, each still encoded."""
    try:
        members = _splitter.decode(body)
    except Malformed as exc:
        raise BatchError(f"malformed batch: {exc}") from None
    if not members or len(members) > MAX_BATCH:
        raise BatchError(f"a batch holds 1 to {MAX_BATCH} messages, this one {len(members)}")
    return [bytes(member) for member in members]


def members(body: bytes) -> list[bytes]:
    """The messages of a body, each still encoded: a batch's members, or the body itself."""
    return split(body) if is_batch(body) else [body]


def join(payloads: list[bytes]) -> bytes:
    """One body for ``payloads`` (each an encoded message): itself when there is one."""
    if len(payloads) == 1:
        return payloads[0]
    return _joiner.encode([msgspec.Raw(payload) for payload in payloads])
