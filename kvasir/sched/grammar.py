"""Structured output's grammars as the engine (llguidance) reads them, and their check at
the entry: a grammar that does not compile is refused with the engine's own words, before
the request reaches a stage."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from kvasir.errors import RequestError
from kvasir.sched.validation import check_grammar_size
from kvasir.wire.base import Grammar

if TYPE_CHECKING:
    from llguidance import GrammarFormat

MAX_CHOICES = 1024  # strings of one "choice" grammar
# JSON comes out compact (no whitespace between tokens: a small model could loop on
# newlines), and a schema keyword the engine does not implement is refused, not ignored


def engine_grammar(grammar: Grammar) -> str:
    """The llguidance grammar of ``grammar`` (RequestError when its text is not of its kind)."""
    import llguidance

    kind, text = grammar.kind, grammar.text
    try:
        if kind in ("json", "json_object"):  # compact JSON: no whitespace a small model could run on in
            schema = text if kind == "json" else '{"type": "object"}'
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        if kind == "choice":
            choices = json.loads(text)
            if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
                raise ValueError("a choice grammar is a JSON list of one or more strings")
            if len(choices) > MAX_CHOICES:
                raise ValueError(f"at most {MAX_CHOICES} choices, got {len(choices)}")
        formats: dict[str, GrammarFormat] = {"regex": "regex", "choice": "choice", "grammar": "grammar"}
        return llguidance.grammar_from(formats[kind], text)  # "grammar": Lark, or GBNF converted to it
    except (ValueError, TypeError) as exc:  # json's decode errors are ValueErrors
        raise RequestError("invalid_request", f"the {kind} structured output does not read: {exc}") from None


def check_grammar(grammar: Grammar) -> None:
    """Refuse a grammar that is too long or that the engine cannot compile."""
    import llguidance

    check_grammar_size(grammar)
    error = llguidance.LLMatcher.validate_grammar(engine_grammar(grammar))
    if error:
        raise RequestError("invalid_request", f"the {grammar.kind} structured output does not compile: {error}")
