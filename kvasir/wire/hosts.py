"""The link between the leader's launcher and each follower (``kvasird join``) of a plan
across hosts: the launcher binds a ROUTER (``hosts``), each follower connects a DEALER
named after its host, both CURVE-authenticated with the hosts' keys.

The follower says it is alive about twice a second, from the moment it starts; the launcher pings
back as often (silence either way, for the plan's ``cluster.host_silence_s``, or for
1.2 s after a connection dropped (kvasir/transport/resets.py), means the other is gone). The
launcher hands the follower workers (``Run``: their settings and the shared memory to
make for them), stops some of them (``Stop``: an instance restarts or moves, the others
run on) or all (``Halt``); the follower reports each worker it started and each that
exited. A ``generation`` numbers each ``Run``, so a report about a worker of an older
start is never taken for one about the current worker of that name.
"""

from __future__ import annotations

from kvasir.wire.base import Tagged
from kvasir.wire.control import HostSegments, WorkerSettings

ALIVE_EVERY_S = 0.5  # how often a follower says it is alive
PING_EVERY_S = 0.5  # how often the launcher pings each follower


# -- follower -> launcher --------------------------------------------------------------
class Alive(Tagged, frozen=True):
    """A follower's hello and heartbeat: its host, pid and the digest of its plan's layout
    (kvasir/transport/routes.py ``plan_digest``), which must be the leader's."""

    host: str
    pid: int
    digest: str
    model: str  # the weights' fingerprint and dtype (kvasir/model/fingerprint.py), which must be the leader's


class Spawned(Tagged, frozen=True):
    generation: int
    name: str  # "stage-1", "shard-0"
    pid: int


class Exited(Tagged, frozen=True):
    generation: int
    name: str
    pid: int  # 0: it never started
    code: int  # the exit status (negative: killed by that signal)
    reason: str = ""  # why the follower stopped it, when it did


FollowerMessage = Alive | Spawned | Exited


# -- launcher -> follower --------------------------------------------------------------
class Run(Tagged, frozen=True):
    """Make the shared memory, start these workers (stopping those of their names that
    still run); the host's other workers run on."""

    generation: int
    prefix: str  # the leader's segment prefix: the follower renames segments to its own
    segments: HostSegments
    workers: list[WorkerSettings]


class Halt(Tagged, frozen=True):
    """Stop (kill) every worker: the ring failed, or the daemon stops."""

    reason: str


class Stop(Tagged, frozen=True):
    """Stop (kill) these workers of the host: their instance restarts, moves or parks."""

    names: list[str]
    reason: str


class Ping(Tagged, frozen=True):
    """The launcher's heartbeat."""


class Refused(Tagged, frozen=True):
    """The launcher will not take this follower (a plan that differs, a key of another host)."""

    reason: str


LeaderMessage = Run | Stop | Halt | Ping | Refused
