"""The conductor: which instance serves each request (``[route] policy``).

- ``round_robin``: the serving instances in turn.
- ``least_loaded``: the instance with the fewest of the bridge's requests on it now.
- ``cache_aware`` (the default): the instance where the request's first token costs the
  least work: the prompt tokens it would compute (those not already in its prefix cache),
  plus half the prompt tokens queued on it ahead of them (a ring's batches take several
  requests' chunks at once, so queued work partly runs alongside), plus one per request
  it runs.

Cache-aware routing keeps an index of the prefix blocks each instance holds, by their
chained keys (kvasir/sched/prefix.py), fed by the heads' own ``PrefixEvents`` when blocks
are registered and evicted. A request routed to an instance is expected to leave its
prompt's blocks there, so its keys are entered at once and kept for ``PREDICTED_S`` unless
the head confirms them: a burst of requests sharing a prefix goes to one instance
instead of being spread before the first has been computed.

In a disaggregated plan the prefill instance is picked as above and the decode instance
by its load: the fewest requests on it, then the most free KV blocks (as its head last
reported them).

A request that names a session (a conversation's or a user's id) goes where the
session's earlier requests went, whatever the policy, while that instance serves
(``affinity``); the conductor remembers the last ``SESSIONS_KEPT`` sessions.

Policy only: no sockets. The bridge tells it what it sends and what comes back.
"""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from kvasir.config.sections import RoutePolicy
from kvasir.errors import RequestError
from kvasir.sched.prefix import block_keys

InstanceState = Literal["serving", "down", "leaving"]  # leaving: moving to another pool, nothing new goes to it
BACKLOG_WEIGHT = 0.5  # what a queued prompt token costs a new request, against one of its own
SESSIONS_KEPT = 1 << 16  # sessions whose instance the conductor remembers (least recently used forgotten)
PREDICTED_S = 10.0  # an entered key the head does not confirm within this is forgotten
CONFIRMED = math.inf


@dataclass
class Candidate:
    """One instance as the conductor sees it."""

    name: str
    block_size: int  # its prefix cache's block size
    capacity: int  # its KV blocks (the index keeps at most twice as many keys, confirmed and predicted)
    state: InstanceState = "serving"
    running: int = 0  # the bridge's requests on it now
    backlog: int = 0  # prompt tokens of those still waiting for their first token, less what was cached
    routed: int = 0  # requests sent to it since the daemon started
    used: int = 0  # a decode instance: KV blocks its head holds (its last report)
    keys: dict[bytes, float] = field(default_factory=dict)  # prefix block key -> until when (inf: confirmed)

    def cached_tokens(self, keys: Sequence[bytes], now: float) -> int:
        """Tokens of the longest prefix of ``keys`` this instance holds (or is expected to)."""
        held = 0
        for key in keys:
            until = self.keys.get(key)
            if until is None or until < now:
                break
            held += 1
        return held * self.block_size


@dataclass(frozen=True)
class Choice:
    name: str
    reason: str
    cached_tokens: int = 0  # prompt tokens the conductor expects the instance to have cached
    backlog: int = 0  # what the request adds to the instance's backlog
    pooled: int = 0  # the prompt's first blocks the instance can read back from the KV pool
    peers: tuple[tuple[int, int], ...] = ()  # (stage, peer): where a stage reads what its host lacks


class Conductor:
    def __init__(
        self, policy: RoutePolicy, candidates: Iterable[Candidate], decoders: Iterable[Candidate] = ()
    ) -> None:
        """``candidates``: the instances that admit requests (colocated, or prefill);
        ``decoders``: a disaggregated plan's decode instances."""
        self.policy = policy
        self.candidates = {c.name: c for c in candidates}
        self.decoders = {c.name: c for c in decoders}
        self.sessions: OrderedDict[bytes, str] = OrderedDict()  # session key -> its instance
        self._turn = itertools.count()

    def pick_decode(self) -> str | None:
        """The decode instance for a request (None: a colocated plan); raises
        RequestError("restarting") when none serves."""
        if not self.decoders:
            return None
        live = [c for c in self.decoders.values() if c.state == "serving"]
        if not live:
            raise RequestError("restarting", "no decode instance is serving: retry in a few seconds")
        chosen = min(live, key=lambda c: (c.running + c.used / max(c.capacity, 1), c.routed))
        chosen.running += 1
        chosen.routed += 1
        return chosen.name

    def decode_ended(self, name: str) -> None:
        chosen = self.decoders.get(name)
        if chosen is not None:
            chosen.running = max(0, chosen.running - 1)

    def kv_used(self, name: str, blocks: int) -> None:
        """A decode instance's head reported the KV blocks it holds."""
        chosen = self.decoders.get(name)
        if chosen is not None:
            chosen.used = blocks

    def serving(self) -> list[Candidate]:
        return [c for c in self.candidates.values() if c.state == "serving"]

    def pick(self, prompt: Sequence[int], root: bytes, now: float, session: bytes | None = None) -> Choice:
        """The instance for a prompt (in the cache namespace ``root``; ``session``: its
        session's key, for affinity); raises RequestError("restarting") when none is serving."""
        live = self.serving()
        if not live:
            raise RequestError("restarting", "no instance is serving: retry in a few seconds")
        keys = _Keys(prompt, root)
        home = self.sessions.get(session) if session is not None else None
        if home is not None and home in self.candidates and self.candidates[home].state == "serving":
            choice = Choice(home, "affinity: the instance of the session's earlier requests", backlog=len(prompt))
        elif self.policy == "round_robin":
            chosen = live[next(self._turn) % len(live)]
            choice = Choice(chosen.name, "round_robin", backlog=len(prompt))
        elif self.policy == "least_loaded":
            chosen = min(live, key=lambda c: (c.running, c.routed))
            choice = Choice(chosen.name, f"least_loaded: {chosen.running} requests on it", backlog=len(prompt))
        else:
            choice = self._cache_aware(live, keys, now)
        self._routed(self.candidates[choice.name], choice, keys, now)
        if session is not None:
            self.sessions[session] = choice.name
            self.sessions.move_to_end(session)
            if len(self.sessions) > SESSIONS_KEPT:
                self.sessions.popitem(last=False)
        return choice

    def _cache_aware(self, live: list[Candidate], keys: _Keys, now: float) -> Choice:
        prompt = keys.prompt
        scored = []
        for c in live:
            cached = min(c.cached_tokens(keys.of(c.block_size), now), len(prompt) - 1)
            scored.append((len(prompt) - cached + BACKLOG_WEIGHT * c.backlog + c.running, c.routed, c.name, cached))
        cost, _, name, cached = min(scored)
        chosen = self.candidates[name]
        reason = (
            f"cache_aware: {cached} of {len(prompt)} prompt tokens cached, "
            f"{chosen.backlog} queued, {chosen.running} requests running"
        )
        return Choice(name, reason, cached, len(prompt) - cached)

    def _routed(self, chosen: Candidate, choice: Choice, keys: _Keys, now: float) -> None:
        chosen.routed += 1
        chosen.running += 1
        chosen.backlog += choice.backlog
        if self.policy != "cache_aware":
            return
        for key in keys.of(chosen.block_size):
            if chosen.keys.get(key, 0.0) != CONFIRMED:
                chosen.keys[key] = now + PREDICTED_S
        self._trim(chosen, now)

    def first_token(self, name: str, backlog: int) -> None:
        """A request's first token came: its prompt tokens leave the instance's backlog."""
        chosen = self.candidates.get(name)
        if chosen is not None:
            chosen.backlog = max(0, chosen.backlog - backlog)

    def ended(self, name: str, backlog: int, decode: str | None = None) -> None:
        """A request ended (``backlog``: what it still had in the backlog, if no first
        token; ``decode``: its decode instance)."""
        chosen = self.candidates.get(name)
        if chosen is not None:
            chosen.running = max(0, chosen.running - 1)
            chosen.backlog = max(0, chosen.backlog - backlog)
        if decode is not None:
            self.decode_ended(decode)

    def events(self, name: str, stored: Iterable[bytes], removed: Iterable[bytes], reset: bool) -> None:
        """An instance's head registered and evicted prefix blocks (``reset``: ``stored``
        is everything it holds; forget the rest). A decode instance's are kept too: a
        move keeps its cache (kvasir/stage/roles.py)."""
        chosen = self.candidates.get(name) or self.decoders.get(name)
        if chosen is None:
            return
        if reset:
            chosen.keys = {key: until for key, until in chosen.keys.items() if until != CONFIRMED}
        for key in removed:
            chosen.keys.pop(key, None)
        for key in stored:
            chosen.keys[key] = CONFIRMED

    def down(self, name: str) -> None:
        """An instance failed: nothing is routed to it, its requests and cache are gone."""
        chosen = self.candidates.get(name) or self.decoders.get(name)
        if chosen is not None:
            chosen.state, chosen.running, chosen.backlog, chosen.keys, chosen.used = "down", 0, 0, {}, 0

    def up(self, name: str) -> None:
        chosen = self.candidates.get(name) or self.decoders.get(name)
        if chosen is not None:
            chosen.state = "serving"

    def leave(self, name: str) -> None:
        """An instance is moving to another pool: nothing new is routed to it; what runs
        there finishes (and is counted)."""
        chosen = self.candidates.get(name) or self.decoders.get(name)
        if chosen is not None:
            chosen.state = "leaving"

    def assign(self, name: str, decode: bool) -> None:
        """An instance serves the decode pool (``decode``) or admits requests: it joins
        that side with nothing on it, down until ``up``; its cache's keys stay (its
        stages keep their KV cache when they change pools)."""
        chosen = self.candidates.pop(name, None) or self.decoders.pop(name)
        chosen.state, chosen.running, chosen.backlog, chosen.used = "down", 0, 0, 0
        (self.decoders if decode else self.candidates)[name] = chosen

    def _trim(self, chosen: Candidate, now: float) -> None:
        """Forget expired predictions once the index outgrows what the instance can hold."""
        bound = 2 * chosen.capacity
        if len(chosen.keys) <= bound:
            return
        chosen.keys = {key: until for key, until in chosen.keys.items() if until >= now}
        predicted = sorted((until, key) for key, until in chosen.keys.items() if until != CONFIRMED)
        for _, key in predicted[: max(0, len(chosen.keys) - bound)]:  # still too many: the oldest go
            del chosen.keys[key]


class _Keys:
    """A prompt's block keys, made once per block size."""

    def __init__(self, prompt: Sequence[int], root: bytes) -> None:
        self.prompt, self.root = prompt, root
        self._made: dict[int, list[bytes]] = {}

    def of(self, block_size: int) -> list[bytes]:
        if block_size not in self._made:
            full = len(self.prompt) // block_size
            self._made[block_size] = block_keys(self.prompt, block_size, full, self.root)
        return self._made[block_size]
