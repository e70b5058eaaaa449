"""One request's logits processing at the tail, before temperature: bad words, the stop
tokens barred before ``min_tokens``, ``logit_bias``, then the repetition, frequency and
presence penalties, with vLLM's meanings (kvasir/wire/batch.py ``SamplingParams``); and
``min_p`` after temperature. Greedy requests are processed too: the penalties change
which token is best.

The history the penalties read (the prompt's ids, the tokens output so far) comes with
the request's ``NewRequest`` from its head, so a decode pool's tail, or a tail that took
the request over, starts from where the sampling stood.
"""

from __future__ import annotations

from collections import Counter

import torch

from kvasir.wire.base import MAX_BAD_WORD_TOKENS
from kvasir.wire.batch import SamplingParams

NEG_INF = float("-inf")


class LogitsShaper:
    """The processing of one request's logits, and the output history it reads."""

    def __init__(
        self, params: SamplingParams, stop_ids: frozenset[int], prompt: tuple[int, ...], output: tuple[int, ...]
    ) -> None:
        self.params = params
        self.stop_ids = torch.tensor(sorted(stop_ids), dtype=torch.long)
        self.bias_ids = torch.tensor([tok for tok, _ in params.logit_bias], dtype=torch.long)
        self.bias = torch.tensor([bias for _, bias in params.logit_bias], dtype=torch.float32)
        self.history = params.penalises_output
        self.counts: Counter[int] = Counter(output if self.history else ())
        self.seen = set(prompt) | set(self.counts) if params.repetition_penalty != 1 else set()
        self.recent = list(output[-MAX_BAD_WORD_TOKENS:]) if params.bad_words else []
        self.active = bool(self.history or params.logit_bias or params.min_tokens)

    def record(self, token: int) -> None:
        """A token the request output (after ``shape`` chose it)."""
        if self.history:
            self.counts[token] += 1
            if self.params.repetition_penalty != 1:
                self.seen.add(token)
            if self.params.bad_words:
                self.recent = [*self.recent[1 - MAX_BAD_WORD_TOKENS :], token]

    def shape(self, logits: torch.Tensor, generated: int) -> torch.Tensor:
        """A processed copy of one row's logits [vocab] (float32), ``generated`` tokens output so far."""
        if not self.active:
            return logits
        logits = logits.clone()
        params = self.params
        banned = self._banned()
        if banned:
            logits[torch.tensor(banned, dtype=torch.long)] = NEG_INF
        if generated < params.min_tokens and len(self.stop_ids):
            logits[self.stop_ids] = NEG_INF
        if len(self.bias_ids):
            logits.index_add_(0, self.bias_ids, self.bias)
        if self.seen:
            self._repetition(logits)
        if self.counts and (params.frequency_penalty or params.presence_penalty):
            ids = torch.tensor(list(self.counts), dtype=torch.long)
            times = torch.tensor(list(self.counts.values()), dtype=torch.float32)
            logits[ids] -= params.frequency_penalty * times + params.presence_penalty
        return logits

    def _repetition(self, logits: torch.Tensor) -> None:
        ids = torch.tensor(sorted(self.seen), dtype=torch.long)
        chosen = logits[ids]
        penalty = self.params.repetition_penalty
        logits[ids] = torch.where(chosen > 0, chosen / penalty, chosen * penalty)

    def _banned(self) -> list[int]:
        """The last token of each bad word whose other tokens the output ends with."""
        banned = []
        for word in self.params.bad_words:
            before = list(word[:-1])
            if not before or self.recent[-len(before) :] == before:
                banned.append(word[-1])
        return banned


def keep_min_p(scores: torch.Tensor, min_p: float) -> torch.Tensor:
    """Scores (after temperature) with every token less likely than ``min_p`` times the
    most likely one sent to -inf."""
    if min_p <= 0:
        return scores
    probs = torch.softmax(scores, dim=-1)
    return scores.masked_fill(probs < min_p * probs.max(), NEG_INF)
