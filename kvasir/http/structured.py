"""Structured output over HTTP: OpenAI's ``response_format``, vLLM's ``structured_outputs``
and its older ``guided_*`` fields, read into one ``Grammar`` the bridge checks and the tail
follows (kvasir/stage/grammar.py). A request gives at most one."""

from __future__ import annotations

import json
from typing import Any

from kvasir.http.errors import invalid
from kvasir.http.schema import ResponseFormat, StructuredOutputs, _Sampling
from kvasir.wire.base import Grammar


def grammar_of(req: _Sampling) -> Grammar | None:
    """The request's structured output (None: free text); a 400 naming the field that is
    malformed, or the second field where two ask."""
    given = [
        (name, grammar)
        for name, grammar in (
            ("response_format", _response_format(req.response_format)),
            ("structured_outputs", _structured(req.structured_outputs)),
            ("guided_json", _json(req.guided_json)),
            ("guided_regex", Grammar("regex", req.guided_regex) if req.guided_regex is not None else None),
            ("guided_choice", _choice(req.guided_choice, "guided_choice")),
            ("guided_grammar", Grammar("grammar", req.guided_grammar) if req.guided_grammar is not None else None),
        )
        if grammar is not None
    ]
    if len(given) > 1:
        raise invalid(f"{given[0][0]} and {given[1][0]} both ask for a structured output: give one", given[1][0])
    return given[0][1] if given else None


def _response_format(form: ResponseFormat | None) -> Grammar | None:
    if form is None or form.type == "text":
        return None
    if form.type == "json_object":
        return Grammar("json_object")
    if form.json_schema is None or form.json_schema.schema is None:
        raise invalid("response_format of type json_schema needs json_schema.schema", "response_format")
    return _json(form.json_schema.schema)


def _structured(spec: StructuredOutputs | None) -> Grammar | None:
    if spec is None:
        return None
    found = [
        grammar
        for grammar in (
            _json(spec.json),
            Grammar("regex", spec.regex) if spec.regex is not None else None,
            _choice(spec.choice, "structured_outputs"),
            Grammar("grammar", spec.grammar) if spec.grammar is not None else None,
            Grammar("json_object") if spec.json_object else None,
        )
        if grammar is not None
    ]
    if len(found) != 1:
        raise invalid(
            f"structured_outputs gives {len(found)} of json, regex, choice, grammar and json_object: give one",
            "structured_outputs",
        )
    return found[0]


def _json(schema: dict[str, Any] | str | None) -> Grammar | None:
    if schema is None:
        return None
    return Grammar("json", schema if isinstance(schema, str) else json.dumps(schema))


def _choice(choices: list[str] | None, param: str) -> Grammar | None:
    if choices is None:
        return None
    if not choices:
        raise invalid(f"{param}: a choice is one of at least one string", param)
    return Grammar("choice", json.dumps(choices))
