"""The head's speculative-decoding policy (docs/speculative.md): which decode rows of a
batch carry drafts, how many, and what each request's drafts earned.

Drafts are deterministic guesses (kvasir/sched/ngram.py), so the tail's rule, keep a
draft while its own sample equals it, is the rejection-sampling rule for a proposal
that puts all its mass on one token: the output's distribution is the model's, and with
a seed the output is the output without drafts.

Speculation turns itself down in two ways:
- a batch with more decode rows than ``max_rows`` drafts for none (its extra tokens
  would take compute the other rows need);
- a request whose drafts are rarely confirmed (a running rate under
  ``min_acceptance``) drafts one token every ``PROBE_EVERY`` rows until one is.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvasir.config.speculative import SpeculativeSpec
from kvasir.sched.ngram import NgramIndex
from kvasir.sched.requests import RequestState
from kvasir.wire.stats import DraftCounters

PROBE_EVERY = 8  # a request drafting below min_acceptance tries one draft in this many rows
SMOOTHING = 0.5  # a row's share of confirmed drafts weighs this much in the request's running rate


@dataclass
class Drafting:
    """One request's drafting: its tokens' index and how its drafts fare."""

    index: NgramIndex
    rate: float = 1.0  # running share of its drafts the model confirmed
    quiet: int = 0  # rows since it last drafted while under min_acceptance


class Speculation:
    def __init__(self, spec: SpeculativeSpec) -> None:
        self.spec = spec
        self._requests: dict[int, Drafting] = {}
        self.full_rows = 0  # decode rows not drafted for: the batch had too many
        self.quiet_rows = 0  # decode rows not drafted for: their request's drafts were rarely confirmed

    def draft(self, decode: list[RequestState], spare: int) -> None:
        """Set the drafts of the requests whose decode rows the next batch carries, within
        ``spare`` tokens of the batch's budget (what its rows' own tokens leave)."""
        if len(decode) > self.spec.max_rows:
            self.full_rows += len(decode)
            return
        for state in decode:
            if spare <= 0:
                return
            if not state.sampling.speculative:
                continue
            drafting = self._drafting(state)
            wanted = min(self._allowance(drafting), spare)
            if wanted:
                state.draft = drafting.index.propose(wanted)
                spare -= len(state.draft)

    def verified(self, request_id: int, drafted: int, accepted: int) -> None:
        """A row with ``drafted`` drafts came back with ``accepted`` of them confirmed."""
        drafting = self._requests.get(request_id)
        if drafting is not None and drafted:
            drafting.rate += SMOOTHING * (accepted / drafted - drafting.rate)

    def forget(self, request_id: int) -> None:
        self._requests.pop(request_id, None)

    def counters(self) -> DraftCounters:
        return DraftCounters(full_rows=self.full_rows, quiet_rows=self.quiet_rows)

    def _allowance(self, drafting: Drafting) -> int:
        if drafting.rate >= self.spec.min_acceptance:
            return self.spec.num_tokens
        drafting.quiet += 1
        if drafting.quiet < PROBE_EVERY:
            self.quiet_rows += 1
            return 0
        drafting.quiet = 0
        return 1

    def _drafting(self, state: RequestState) -> Drafting:
        """The request's drafting, its index brought up to its newest token (the prompt's
        ids, where this head has them, then the output)."""
        drafting = self._requests.get(state.request_id)
        if drafting is None:
            drafting = self._requests[state.request_id] = Drafting(NgramIndex(self.spec.ngram_min, self.spec.ngram_max))
        index = drafting.index
        prompt = state.prompt or state.context
        known = len(index.tokens)
        if known < len(prompt):
            index.extend(prompt[known:])
            known = len(prompt)
        index.extend(state.output[known - len(prompt) :])
        return drafting
