"""The launcher's supervision policy: bounded restarts with back-off, and heartbeats.

Kept apart from the launcher's process handling so the policy reads (and is tested)
on its own: no processes, no sockets, only times.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class RestartPolicy:
    """At most ``max_restarts`` failures within ``window_s``; then the daemon gives up.

    The first failure in the window restarts at once (a crash is usually a one-off);
    each further one waits twice as long as the one before, from ``backoff_s`` up to
    ``backoff_max_s``, so a ring that keeps failing does not spin.
    """

    max_restarts: int
    window_s: float
    backoff_s: float = 1.0
    backoff_max_s: float = 30.0
    failures: deque[float] = field(default_factory=deque)

    def failed(self, now: float) -> float | None:
        """Record a failure; the delay before the restart, or None to give up."""
        self.failures.append(now)
        while self.failures and self.failures[0] <= now - self.window_s:
            self.failures.popleft()
        recent = len(self.failures)
        if recent > self.max_restarts:
            return None
        if recent == 1:
            return 0.0
        return min(self.backoff_max_s, self.backoff_s * 2 ** (recent - 2))


PAUSE_S = 1.0  # a gap this long between two looks means the launcher itself was not running


@dataclass
class Heartbeats:
    """When each watched child was last heard from; a child silent for ``timeout_s`` is hung.

    Silence only counts while the launcher is there to hear: when the launcher's own
    looks are more than ``PAUSE_S`` apart (the whole process group was stopped with
    Ctrl-Z or frozen by a cgroup, or the machine starved it), the gap is forgiven for
    every child, so a group resumed after a long pause is not killed as hung.
    """

    timeout_s: float
    last: dict[str, float] = field(default_factory=dict)
    looked: float | None = None  # when the launcher last checked

    def watch(self, name: str, now: float) -> None:
        self.last[name] = now

    def beat(self, name: str, now: float) -> None:
        if name in self.last:
            self.last[name] = now

    def forget(self, name: str) -> None:
        self.last.pop(name, None)

    def silent(self, now: float) -> tuple[str, float] | None:
        """The first watched child silent for longer than the timeout, and for how long."""
        gap = now - self.looked if self.looked is not None else 0.0
        self.looked = now
        if gap > PAUSE_S:
            for name in self.last:
                self.last[name] += gap
        for name, seen in self.last.items():
            if now - seen > self.timeout_s:
                return name, now - seen
        return None
