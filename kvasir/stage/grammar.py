"""Structured output at the tail: each constrained request's matcher (llguidance) masks
the tokens that would leave its grammar before the tail samples, and follows every token
the request outputs.

The engine's view of the vocabulary (``llguidance.LLTokenizer``) is built from the model
folder's tokenizer once per tail process, on the first constrained request (about
0.3 s for a 49k vocabulary); compiled grammars are kept by their text, so a schema
repeated by many requests compiles once. A matcher rebuilt for a request the tail meets
after its start (the decode pool's) replays the tokens output so far.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import torch

from kvasir.sched.grammar import engine_grammar
from kvasir.stage.closing import Closing, Vocabulary, allowed, bitmask
from kvasir.wire.base import Grammar

COMPILED_KEPT = 256  # grammars kept compiled, least recently used dropped first


class GrammarError(RuntimeError):
    """A grammar the tail cannot follow (the bridge checked it: a tokenizer the engine refuses)."""


class Grammars:
    """The tail's engine: a matcher for each constrained request."""

    def __init__(self, folder: Path | None, vocab_size: int) -> None:
        self.folder = folder
        self.vocab_size = vocab_size
        self._tokenizer = None
        self._vocabulary: Vocabulary | None = None  # the tokens as closing walks see them (kvasir/stage/closing.py)
        self._compiled: OrderedDict[tuple[str, str], str] = OrderedDict()

    def constraint(self, grammar: Grammar, output: tuple[int, ...]) -> Constraint:
        """A matcher for ``grammar`` that has followed ``output``."""
        import llguidance

        tokenizer = self._engine_tokenizer()
        matcher = llguidance.LLMatcher(tokenizer, self._grammar(grammar), log_level=0)
        if self._vocabulary is None:
            self._vocabulary = Vocabulary.of(tokenizer, self.vocab_size)
        constraint = Constraint(matcher, Closing(matcher, self._vocabulary))
        for token in output:
            constraint.follow(token)
        return constraint

    def _grammar(self, grammar: Grammar) -> str:
        key = (grammar.kind, grammar.text)
        text = self._compiled.pop(key, None)
        if text is None:
            text = engine_grammar(grammar)
        self._compiled[key] = text
        while len(self._compiled) > COMPILED_KEPT:
            self._compiled.popitem(last=False)
        return text

    def _engine_tokenizer(self):
        if self._tokenizer is None:
            import llguidance.hf

            from kvasir.model.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(self.folder)
            if tokenizer is None:
                raise GrammarError("structured output needs the model's tokenizer, and this model has none")
            self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=self.vocab_size)
        return self._tokenizer


class Constraint:
    """One request's matcher: the mask of the next token, and the tokens it took."""

    def __init__(self, matcher, closing: Closing) -> None:
        self.matcher = matcher
        self.closing = closing  # keeps a way to close within the budget

    @property
    def done(self) -> bool:
        """The grammar is complete: nothing more may follow."""
        return bool(self.matcher.is_stopped())

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` [vocab] with every token outside the grammar at -inf."""
        keep = torch.from_numpy(allowed(bitmask(self.matcher), logits.shape[-1]))
        if keep.shape[0] < logits.shape[-1]:  # a vocabulary wider than the engine's: the rest is outside
            keep = torch.cat([keep, torch.zeros(logits.shape[-1] - keep.shape[0], dtype=torch.bool)])
        return logits.masked_fill(~keep, float("-inf"))

    def keep(self, token: int, budget: int) -> int:
        """``token`` if the grammar can still close within ``budget`` tokens after it (this
        one included), otherwise a token on the way to close."""
        return self.closing.keep(token, budget)

    def follow(self, token: int) -> None:
        """The request output ``token`` (outside the grammar: the matcher's error says so)."""
        self.matcher.consume_token(token)
        self.closing.follow(token)
