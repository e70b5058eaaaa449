"""Whether a tier is worth trying: a storage fault costs a cache hit, and a tier that
keeps failing is paused instead of failing every slice.

Every failed write or read is counted by operation and reason (an errno's name such as
``ENOSPC``, or ``short``, ``size``, ``mode``...). ``PAUSE_AFTER`` failures in a row pause
the tier for a back-off (``BACKOFF_S``, doubled at each pause that follows a failed try,
up to ``MAX_BACKOFF_S``): nothing is written to it or read from it meanwhile. Once the
back-off is over the next operation tries it; one that works makes it serve again. A
tier refused at start (kvasir/kvpool/files.py ``Refused``) stays refused. Each change of
state is logged once, with the tier's path and the reason; so is the first failure of a
run of them. Shared by the stage's loop, its writer and its slice server (a lock).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Literal

State = Literal["serving", "paused", "refused"]
TierName = Literal["host", "disk"]
Op = Literal["open", "write", "read"]

PAUSE_AFTER = 3  # failures in a row that pause a tier
BACKOFF_S = 5.0
MAX_BACKOFF_S = 300.0


class TierHealth:
    """One tier of one stage: its state, its failures by (op, reason), its last fault."""

    def __init__(self, tier: TierName, path: str, log, clock: Callable[[], float] = time.monotonic) -> None:
        self.tier = tier
        self.path = path
        self.log = log
        self.clock = clock
        self.state: State = "serving"
        self.reason = ""  # the last fault, for stats: "write ENOSPC: No space left on device"
        self.errors: dict[tuple[Op, str], int] = {}
        self._streak = 0
        self._backoff_s = BACKOFF_S
        self._until = 0.0
        self._lock = threading.Lock()

    def usable(self) -> bool:
        """Whether to try the tier now: serving, or paused with its back-off over."""
        with self._lock:
            return self.state == "serving" or (self.state == "paused" and self.clock() >= self._until)

    def counts(self) -> list[tuple[Op, str, int]]:
        """The failures so far: (op, reason, how many), sorted."""
        with self._lock:
            return sorted((op, reason, n) for (op, reason), n in self.errors.items())

    def failed(self, op: Op, reason: str, detail: str, *, tier_fault: bool = True) -> None:
        """One operation failed (counted); the tier pauses after PAUSE_AFTER in a row.
        ``tier_fault`` False: the fault was one file's (not what the pool wrote), counted
        and logged but no sign the tier itself fails."""
        with self._lock:
            self.errors[(op, reason)] = self.errors.get((op, reason), 0) + 1
            self.reason = f"{op} {reason}: {detail}"
            if not tier_fault:
                self.log.warning("kv pool file unfit", tier=self.tier, path=self.path, reason=reason, detail=detail)
                return
            self._streak += 1
            if self.state == "refused":
                return
            if self._streak == 1 and self.state == "serving":
                self.log.warning(
                    "kv pool tier fault", tier=self.tier, path=self.path, op=op, reason=reason, detail=detail
                )
            if self.state == "paused" or self._streak >= PAUSE_AFTER:
                self._pause(op, reason, detail)

    def succeeded(self) -> None:
        with self._lock:
            self._streak = 0
            if self.state == "paused":
                self.state, self._backoff_s = "serving", BACKOFF_S
                self.log.info("kv pool tier serving again", tier=self.tier, path=self.path)

    def refuse(self, reason: str, detail: str) -> None:
        """Refused at start: never used (counted as an ``open`` fault)."""
        with self._lock:
            self.errors[("open", reason)] = self.errors.get(("open", reason), 0) + 1
            self.state, self.reason = "refused", f"open {reason}: {detail}"
        self.log.error("kv pool tier refused; serving without it", tier=self.tier, path=self.path, reason=detail)

    def _pause(self, op: Op, reason: str, detail: str) -> None:
        if self.state == "paused":  # its try after a back-off failed: a longer one
            self._backoff_s = min(2 * self._backoff_s, MAX_BACKOFF_S)
        self.state, self._until = "paused", self.clock() + self._backoff_s
        self.log.warning(
            "kv pool tier paused",
            tier=self.tier,
            path=self.path,
            op=op,
            reason=reason,
            detail=detail,
            for_s=self._backoff_s,
        )
