"""Fair shares of one front between its callers.

A front is one client of the bridge, so its requests share ``bridge.max_per_client``.
Without a share of its own, one caller's requests (a request fans out to prompts x
``n`` submissions) could take all of it and every other caller would get 429. Each
caller (its API key where the plan has keys, else its address) may have at most
``http.max_per_caller`` submissions in flight at this front.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from kvasir.http.errors import ApiError


class Callers:
    def __init__(self, max_per_caller: int) -> None:
        self.max_per_caller = max_per_caller
        self.in_flight: dict[str, int] = {}  # caller -> submissions; a caller with none has no entry

    @contextmanager
    def share(self, caller: str, submissions: int) -> Iterator[None]:
        """Hold ``submissions`` of ``caller``'s share while the block runs; 429 when they
        do not fit in it."""
        held = self.in_flight.get(caller, 0)
        if held + submissions > self.max_per_caller:
            raise ApiError(
                "overloaded",
                f"this caller already has {held} generations running here and asked for {submissions} more: "
                f"at most {self.max_per_caller} at once (http.max_per_caller)",
            )
        self.in_flight[caller] = held + submissions
        try:
            yield
        finally:
            left = self.in_flight[caller] - submissions
            if left:
                self.in_flight[caller] = left
            else:
                del self.in_flight[caller]
