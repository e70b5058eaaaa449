"""Typed decoding of bytes that came from outside the process: every failure is one error.

msgspec raises more than ``DecodeError`` and ``ValidationError`` on hostile input: a
deeply nested body (``b"\\x91" * 1000 + b"\\xc0"``, about 1 KB) raises ``RecursionError``
before any type is checked, even where the nesting sits in a field that is skipped, and
a body that claims a huge container can raise ``MemoryError``. A receiver that catches
only the first two lets such a message kill the task reading the socket. Every decode of
a socket's bytes (and of the settings a worker reads on stdin) goes through ``Decoder``
here, which turns any failure into ``Malformed``; tests/unit/transport/test_envelopes.py checks
that no module of the package builds msgspec's decoders directly.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import msgspec

T = TypeVar("T")


class Malformed(ValueError):
    """Bytes that are not a message of the expected type (the reason in words)."""


def _reason(exc: Exception) -> str:
    if isinstance(exc, RecursionError):
        return "nested too deeply"
    if isinstance(exc, MemoryError):
        return "claims more memory than there is"
    return str(exc) or type(exc).__name__


class Decoder(Generic[T]):
    """msgspec's typed msgpack decoder: ``Malformed`` for anything that does not decode."""

    def __init__(self, message_type: Any) -> None:
        self._decoder = msgspec.msgpack.Decoder(message_type)

    def decode(self, body: Any) -> T:
        try:
            return self._decoder.decode(body)
        except Exception as exc:  # every failure msgspec can raise on untrusted bytes
            raise Malformed(_reason(exc)) from None


class JsonDecoder(Generic[T]):
    """msgspec's typed JSON decoder; ``ValidationError`` and ``DecodeError`` pass through
    (callers turn them into precise messages), anything else becomes ``Malformed``."""

    def __init__(self, message_type: Any) -> None:
        self._decoder = msgspec.json.Decoder(message_type)

    def decode(self, body: Any) -> T:
        try:
            return self._decoder.decode(body)
        except (msgspec.ValidationError, msgspec.DecodeError):
            raise
        except Exception as exc:
            raise Malformed(_reason(exc)) from None


def decode(body: Any, message_type: type[T]) -> T:
    """One msgpack body of ``message_type`` (for one-off decodes: settings on stdin)."""
    return Decoder[T](message_type).decode(body)


def decode_json(body: Any, message_type: Any) -> Any:
    """One JSON document of ``message_type`` (command-line arguments of helper processes)."""
    return JsonDecoder[Any](message_type).decode(body)
