"""Named errors raised at Kvasir's boundaries.

Every error a user can cause carries a message that says what was wrong and, where
there is one, what to do; none of them is an ``assert``.
"""

from __future__ import annotations


class KvasirError(Exception):
    """Base class for errors that Kvasir reports to a user as one clear line."""


class PlanError(KvasirError):
    """A plan file that cannot be served: missing, malformed, or inconsistent."""


class ModelSourceError(KvasirError):
    """A ``model.source`` that does not resolve to a usable model."""


class BatchError(KvasirError):
    """A batch descriptor that contradicts a stage's state (a bug or a hostile peer)."""


class RequestError(KvasirError):
    """A request the engine refuses; ``code`` is the client-protocol error code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
