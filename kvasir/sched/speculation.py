"""The head's speculative-decoding policy (docs/speculative.md): which decode rows of a
batch carry drafts, how many, and what each request's drafts earned.

Drafts are deterministic guesses (kvasir/sched/ngram.py), so the tail's rule, keep a
draft while its own sample equals it, is the rejection-sampling rule for a proposal
that puts all its mass on one token: the output's distribution is the model's, and with
a seed the output is the output without drafts.

Speculation turns itself down in three ways:
- a batch with more decode rows than ``max_rows`` drafts for none (its extra tokens
  would take compute the other rows need);
- a request drafts one more token than its rows have lately had confirmed (a running
  mean), up to ``num_tokens``: long runs of confirmed drafts grow its rows, misses shrink
  them. Prompt lookup's drafts cost nothing to make, so a request starts at
  ``num_tokens``; a draft model's cost a pass each, so it starts at one and grows;
- a request whose drafts are rarely confirmed (a running rate under
  ``min_acceptance``) drafts one token every ``PROBE_EVERY`` rows until one is, and
  each probe the model rejects doubles that interval (up to ``PROBE_MOST``): a request
  drafts are no use to costs next to nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from kvasir.config.speculative import SpeculativeSpec
from kvasir.sched.ngram import NgramIndex
from kvasir.sched.requests import RequestState
from kvasir.wire.stats import DraftCounters

PROBE_EVERY = 8  # a request drafting below min_acceptance tries one draft in this many rows
PROBE_MOST = 128  # and after rejected probes, in at most this many
SMOOTHING = 0.5  # a row's share of confirmed drafts weighs this much in the request's running rate


class Drafter(Protocol):
    """Where drafts come from: prompt lookup (``NgramDrafter``) or a draft model
    (kvasir/stage/drafting.py)."""

    def propose(self, wanted: list[tuple[RequestState, int]]) -> dict[int, list[int]]:
        """Up to the given number of draft tokens for each request (by id; fewer or none
        where it has no guess), continuing its prompt (where the head has it) and output."""
        ...

    def forget(self, request_id: int) -> None: ...


class NgramDrafter:
    """Prompt lookup: one ``NgramIndex`` per request, brought up to its newest token."""

    def __init__(self, spec: SpeculativeSpec) -> None:
        self.spec = spec
        self._indexes: dict[int, NgramIndex] = {}

    def propose(self, wanted: list[tuple[RequestState, int]]) -> dict[int, list[int]]:
        return {state.request_id: self._index(state).propose(count) for state, count in wanted}

    def forget(self, request_id: int) -> None:
        self._indexes.pop(request_id, None)

    def _index(self, state: RequestState) -> NgramIndex:
        index = self._indexes.get(state.request_id)
        if index is None:
            index = self._indexes[state.request_id] = NgramIndex(self.spec.ngram_min, self.spec.ngram_max)
        index.extend(history_after(state, len(index.tokens)))
        return index


def history_after(state: RequestState, have: int) -> list[int]:
    """The tokens of the request's history (its prompt's ids, where this head has them,
    then its output) after its first ``have``."""
    prompt = state.prompt or state.context
    return [*prompt[have:], *state.output[max(0, have - len(prompt)) :]]


@dataclass
class Acceptance:
    """How one request's drafts fare."""

    run: float  # running mean of the drafts confirmed per row
    rate: float = 1.0  # running share of its drafts the model confirmed
    quiet: int = 0  # rows since it last drafted while under min_acceptance
    interval: int = PROBE_EVERY  # rows between its probes while under min_acceptance
    probing: bool = False  # its row in flight carries a probe


class Speculation:
    def __init__(self, spec: SpeculativeSpec, drafter: Drafter) -> None:
        self.spec = spec
        self.drafter = drafter
        # a new request's confirmed drafts per row, as first assumed (its first row drafts one more)
        self.first_run = spec.num_tokens - 1 if spec.method == "ngram" else 0
        self._requests: dict[int, Acceptance] = {}
        self.full_rows = 0  # decode rows not drafted for: the batch had too many
        self.quiet_rows = 0  # decode rows not drafted for: their request's drafts were rarely confirmed

    def draft(self, decode: list[RequestState], spare: int) -> None:
        """Set the drafts of the requests whose decode rows the next batch carries, within
        ``spare`` tokens of the batch's budget (what its rows' own tokens leave)."""
        if len(decode) > self.spec.max_rows:
            self.full_rows += len(decode)
            return
        wanted: list[tuple[RequestState, int]] = []
        for state in decode:
            if spare <= 0:
                break
            if not state.sampling.speculative:
                continue
            acceptance = self._requests.get(state.request_id)
            if acceptance is None:
                acceptance = self._requests[state.request_id] = Acceptance(run=self.first_run)
            count = min(self._allowance(acceptance), spare)
            if count:
                wanted.append((state, count))
                spare -= count
        if wanted:
            proposals = self.drafter.propose(wanted)
            for state, count in wanted:
                state.draft = proposals.get(state.request_id, [])[:count]

    def verified(self, request_id: int, drafted: int, accepted: int) -> None:
        """A row with ``drafted`` drafts came back with ``accepted`` of them confirmed."""
        acceptance = self._requests.get(request_id)
        if acceptance is not None and drafted:
            acceptance.rate += SMOOTHING * (accepted / drafted - acceptance.rate)
            acceptance.run += SMOOTHING * (accepted - acceptance.run)
            if acceptance.probing:
                acceptance.interval = PROBE_EVERY if accepted else min(2 * acceptance.interval, PROBE_MOST)
            acceptance.probing = False

    def forget(self, request_id: int) -> None:
        self._requests.pop(request_id, None)
        self.drafter.forget(request_id)

    def counters(self) -> DraftCounters:
        return DraftCounters(full_rows=self.full_rows, quiet_rows=self.quiet_rows)

    def _allowance(self, acceptance: Acceptance) -> int:
        if acceptance.rate >= self.spec.min_acceptance:
            return min(self.spec.num_tokens, 1 + math.ceil(acceptance.run))
        acceptance.quiet += 1
        if acceptance.quiet < acceptance.interval:
            self.quiet_rows += 1
            return 0
        acceptance.quiet = 0
        acceptance.probing = True
        return 1
