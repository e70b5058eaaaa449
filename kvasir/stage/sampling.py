"""The tail's sampling and finish decisions, per request and reproducible by seed."""

from __future__ import annotations

import msgspec
import torch

from kvasir.errors import BatchError
from kvasir.stage.grammar import Constraint, GrammarError, Grammars
from kvasir.stage.logits import LogitsShaper, keep_min_p
from kvasir.wire.base import FinishReason
from kvasir.wire.batch import BatchDescriptor, NewRequest, PromptScores, Row, SampledToken, SamplingParams
from kvasir.wire.head import BatchResult
from kvasir.wire.stats import DraftCounters

GOLDEN = 0x9E3779B97F4A7C15  # spreads consecutive token indices over the seed space


class RequestSampler:
    """One request's sampling state: its parameters, seeded generator and output count.

    The generator is re-seeded for every token from (seed, token index), so the n-th
    token's draw does not depend on which process drew the earlier ones (in a
    disaggregated plan the prefill pool's tail draws the first, the decode pool's the rest).
    """

    def __init__(
        self, new: NewRequest, eos_ids: tuple[int, ...], max_seq_len: int, grammars: Grammars | None = None
    ) -> None:
        self.params = new.sampling
        self.prompt = new.prompt  # only where its sampling reads it (to score it, or penalise repeats)
        self.queued_ns = new.queued_ns
        self.cached_tokens = new.cached_tokens
        self.pooled_tokens = new.pooled_tokens
        self.generator = torch.Generator(device="cpu")
        self.seed = new.seed
        eos = () if new.sampling.ignore_eos else eos_ids
        self.stop_ids = frozenset(eos) | frozenset(new.sampling.stop_token_ids)
        self.max_seq_len = max_seq_len
        self.generated = new.generated
        self.draws = new.generated  # the index of the token the next pick chooses
        self.passes = new.generated  # rows that emitted its tokens (each earlier token counts as one)
        self.drafted = 0  # draft tokens checked for it here
        self.accepted = 0  # of those, confirmed
        self.shaper = LogitsShaper(new.sampling, self.stop_ids, new.prompt, new.output)
        self.constraint = self._constraint(new, grammars)

    def pick(self, logits: torch.Tensor) -> int:
        """Choose the next token from one row's logits [vocab] (float32, CPU): shaped,
        masked by the request's grammar, drawn, and (structured output) kept within reach
        of the grammar's end in the tokens max_tokens leaves (kvasir/stage/closing.py)."""
        logits = self.shaper.shape(logits, self.generated)
        if self.constraint is None:
            return self._draw(logits)
        token = self._draw(self.constraint.mask(logits))
        return self.constraint.keep(token, self.params.max_tokens - self.generated)  # max_tokens never cuts it

    def _draw(self, logits: torch.Tensor) -> int:
        """One token from ``logits``.

        Any temperature validation lets through is computable: the logits are shifted so
        the best is 0 and divided in float64, so a tiny temperature sends every other
        token to -inf (never NaN: 0 / t is 0 for any t > 0) and softmax stays a
        distribution; a huge one flattens it. Logits that are themselves not finite (a
        float16 overflow upstream) fall back to the best finite token.
        """
        params = self.params
        if params.temperature == 0:
            self.draws += 1
            return _argmax(logits)
        best = logits.max()
        if not torch.isfinite(best):
            self.draws += 1
            return _argmax(logits)
        scores = keep_min_p((logits - best).double() / params.temperature, params.min_p)
        if 0 < params.top_k < scores.shape[-1]:
            kth = torch.topk(scores, params.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if params.top_p < 1.0:
            ordered, order = torch.sort(scores, descending=True)
            probs = torch.softmax(ordered, dim=-1)
            # drop a token once the tokens ranked above it already reach top_p
            drop = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
            drop[0] = False
            scores = scores.scatter(0, order[drop], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        self.generator.manual_seed((self.seed + self.draws * GOLDEN) & (2**63 - 1))
        self.draws += 1
        return _inverse_cdf(probs, self.generator)

    @staticmethod
    def _constraint(new: NewRequest, grammars: Grammars | None) -> Constraint | None:
        grammar = new.sampling.grammar
        if grammar is None:
            return None
        if grammars is None:
            raise BatchError(f"request {new.request_id} asks for structured output, which this tail cannot follow")
        try:
            return grammars.constraint(grammar, new.output)
        except GrammarError as exc:
            raise BatchError(f"request {new.request_id}: {exc}") from None

    def finish(self, token: int, length: int) -> FinishReason | None:
        """Finish reason after appending ``token``; ``length`` = prompt + output so far."""
        self.generated += 1
        self.shaper.record(token)
        if self.constraint is not None:
            self.constraint.follow(token)
            if self.constraint.done:
                return "stop"  # the structured output is complete
        if token in self.stop_ids:
            return "stop"
        if self.generated >= self.params.max_tokens or length >= self.max_seq_len:
            return "length"
        return None


def _scores(logits: torch.Tensor, token: int, top: int) -> dict:
    """``token``'s log-probability under the model's own distribution (before temperature,
    top-k or top-p, as vLLM reports them) and the ``top`` most likely tokens'."""
    logprobs = _log_probs(logits)
    return {"logprob": float(logprobs[token]), "top": _best(logprobs[None], top)[0]}


def _log_probs(logits: torch.Tensor) -> torch.Tensor:
    """Log-probabilities over the last dimension; logits that are NaN count as impossible
    (-inf), so no log-probability is NaN."""
    return torch.log_softmax(torch.nan_to_num(logits.float(), nan=float("-inf")), dim=-1)


def _best(logprobs: torch.Tensor, top: int) -> list[tuple[tuple[int, float], ...]]:
    """Per row of [R, vocab] log-probabilities: the ``top`` most likely (id, log-probability), best first."""
    if not top:
        return [()] * logprobs.shape[0]
    best = torch.topk(logprobs, min(top, logprobs.shape[-1]))
    return [tuple(zip(ids, values)) for ids, values in zip(best.indices.tolist(), best.values.tolist())]


def _argmax(logits: torch.Tensor) -> int:
    """The best token (the first of equals), NaN logits ignored. NumPy's argmax over a
    49,152-token vocabulary takes microseconds where torch's takes tens, on the path of
    every greedy token; it returns the first NaN if there is one, which sends the row the
    slow way."""
    values = logits.numpy()
    best = int(values.argmax())
    if values[best] == values[best]:
        return best
    return int(torch.argmax(torch.nan_to_num(logits, nan=float("-inf"))))  # NaN compares false: never chosen


def _inverse_cdf(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token drawn from ``probs`` [vocab] (float64): the first whose cumulative
    probability passes a uniform draw scaled to their total. One random number, where
    ``torch.multinomial`` draws one exponential per token (a millisecond over a
    49,152-token vocabulary). A token of probability 0 is never drawn: its cumulative sum
    equals its predecessor's."""
    cumulative = torch.cumsum(probs, dim=0)
    point = torch.rand((), dtype=torch.float64, generator=generator) * cumulative[-1]
    index = int(torch.searchsorted(cumulative, point, right=True))
    if index < probs.shape[0]:
        return index
    return int(torch.nonzero(probs)[-1])  # the draw rounded up to the total: the last possible token


class Sampler:
    """The tail's samplers for every request it currently knows."""

    def __init__(
        self, eos_ids: tuple[int, ...], max_seq_len: int, grammars: Grammars | None = None, speculative: bool = False
    ) -> None:
        """``speculative``: the plan drafts (kvasir/config/speculative.py): report the drafts' fate."""
        self.eos_ids = eos_ids
        self.speculative = speculative
        self.totals = DraftCounters()  # tail's side (counted where speculative): rows, tokens, drafted, accepted
        self.max_seq_len = max_seq_len
        self.grammars = grammars  # structured output (None: a tail that cannot follow grammars)
        self._requests: dict[int, RequestSampler] = {}
        self._admitted: BatchDescriptor | None = None  # the batch whose releases and new requests are in
        self._scoring: tuple[BatchDescriptor | None, tuple[int, ...]] = (None, ())
        self._prompt_scores: tuple[PromptScores, ...] = ()

    def __len__(self) -> int:
        return len(self._requests)

    def spec(self, request_id: int) -> tuple[SamplingParams, int, tuple[int, ...]]:
        """A running request's sampling parameters, seed and the prompt ids its sampling
        reads (to hand it to another pool)."""
        state = self._requests[request_id]
        return state.params, state.seed, state.prompt

    def scored(self, descriptor: BatchDescriptor) -> tuple[int, ...]:
        """The requests whose rows in this batch are prompt chunks to score: the stage
        computes logits at their every token, after the emitting rows' (``sample``)."""
        self._admit(descriptor)
        rows = tuple(row.request_id for row in descriptor.rows if self._is_prompt_chunk(row))
        self._scoring = (descriptor, rows)
        return rows

    def take_prompt_scores(self) -> tuple[PromptScores, ...]:
        """The prompt scores of the batch ``sample`` last saw."""
        scores, self._prompt_scores = self._prompt_scores, ()
        return scores

    def sample(self, descriptor: BatchDescriptor, logits: torch.Tensor) -> BatchResult:
        """Sample the tokens of every emitting row of the batch (one, or with drafts up to
        one per draft and one more); logits are one per sampled position, then one per
        token of the rows ``scored`` named for this batch."""
        self._admit(descriptor)
        scoring = self._scoring[1] if self._scoring[0] is descriptor else ()
        logits = logits.float().cpu()
        emitting = [row for row in descriptor.rows if row.emit]
        scored = [row for row in descriptor.rows if row.request_id in scoring]
        sampled = sum(row.samples for row in emitting)
        if sampled + sum(row.num_tokens for row in scored) != logits.shape[0]:
            raise BatchError(
                f"batch {descriptor.batch_id}: {len(emitting)} emitting rows, {logits.shape[0]} logits "
                f"(for {sampled} sampled positions)"
            )
        self._prompt_scores = tuple(self._score(scored, logits[sampled:]))  # before any request ends
        tokens: list[SampledToken] = []
        for row in emitting:
            tokens += self._pick(descriptor, row, logits[: row.samples])
            logits = logits[row.samples :]
        return BatchResult(descriptor.batch_id, tuple(tokens))

    def _admit(self, descriptor: BatchDescriptor) -> None:
        """Apply a batch's releases and new requests, once whichever of scored/sample comes first."""
        if self._admitted is descriptor:
            return
        self._admitted = descriptor
        for rid in descriptor.release:
            self._requests.pop(rid, None)
        for new in descriptor.new_requests:
            self._requests[new.request_id] = RequestSampler(new, self.eos_ids, self.max_seq_len, self.grammars)

    def _pick(self, descriptor: BatchDescriptor, row: Row, logits: torch.Tensor) -> list[SampledToken]:
        """A row's tokens from its sampled positions' logits [1 + drafts, vocab]: each
        sample is emitted; a draft it confirms lets the next position's sample follow."""
        state = self._requests.get(row.request_id)
        if state is None:
            raise BatchError(f"batch {descriptor.batch_id}: request {row.request_id} has no sampling spec")
        length = row.start + row.num_tokens - len(row.draft)  # prompt + output before this row's first sample
        state.passes += 1
        state.drafted += len(row.draft)
        confirmed = 0
        tokens: list[SampledToken] = []
        for at, position in enumerate(logits):
            token = state.pick(position)
            confirms = at < len(row.draft) and token == row.draft[at]
            confirmed += confirms
            state.accepted += confirms
            finish = state.finish(token, length + at + 1)
            tokens.append(self._token(state, row.request_id, token, finish, position))
            if finish is not None:
                del self._requests[row.request_id]
                break
            if not confirms:
                break  # the bonus token, or the first draft the model does not confirm
        if self.speculative:
            self._count(len(row.draft), confirmed, len(tokens))
        return tokens

    def _count(self, drafted: int, confirmed: int, emitted: int) -> None:
        self.totals += DraftCounters(
            rows=1, tokens=emitted, draft_rows=int(drafted > 0), drafted=drafted, accepted=confirmed
        )

    def drafts(self) -> DraftCounters | None:
        """The tail's counts of drafts checked and confirmed (a plan with [speculative])."""
        return self.totals if self.speculative else None

    @staticmethod
    def _token(
        state: RequestSampler, request_id: int, token: int, finish: FinishReason | None, logits: torch.Tensor
    ) -> SampledToken:
        first = state.generated == 1
        last = finish is not None  # the request's figures go with its last token
        sampled = SampledToken(
            request_id,
            token,
            state.generated - 1,
            finish,
            state.queued_ns if first else 0,
            state.cached_tokens if first else 0,
            state.pooled_tokens if first else (0, 0, 0),
            passes=state.passes if last else 0,
            drafted=state.drafted if last else 0,
            accepted=state.accepted if last else 0,
        )
        if state.params.logprobs >= 0:
            sampled = msgspec.structs.replace(sampled, **_scores(logits, token, state.params.logprobs))
        return sampled

    def _is_prompt_chunk(self, row: Row) -> bool:
        state = self._requests.get(row.request_id)
        return state is not None and state.params.prompt_logprobs >= 0 and row.start < len(state.prompt) - 1

    def _score(self, rows: list[Row], logits: torch.Tensor):
        """Each scored row's prompt tokens after its first position: the log-probability of
        the token at p + 1 from the logits at p (the row's last logits may predict the
        first output token instead: that one is sampled, not scored)."""
        offset = 0
        for row in rows:
            state = self._requests[row.request_id]
            chunk, offset = logits[offset : offset + row.num_tokens], offset + row.num_tokens
            count = min(row.start + row.num_tokens, len(state.prompt) - 1) - row.start
            targets = state.prompt[row.start + 1 : row.start + 1 + count]
            logprobs = _log_probs(chunk[:count])
            chosen = logprobs.gather(1, torch.tensor(targets)[:, None])[:, 0].tolist()
            pairs = tuple(_best(logprobs, state.params.prompt_logprobs))
            yield PromptScores(row.request_id, row.start + 1, tuple(targets), tuple(chosen), pairs)
