"""Struct bases of every wire message, and the size limit shared by requests and submissions."""

from __future__ import annotations

from typing import Literal

import msgspec

# States and names that travel, as Literal types: msgspec refuses any other value while
# decoding, so a receiver never compares against a string it does not know.
Role = Literal["stage", "bridge", "shard", "front"]  # a child process of the launcher (front: HTTP)
Side = Literal["producer", "consumer"]  # a stage's end of an edge
FinishReason = Literal["stop", "length"]
DaemonState = Literal["serving", "restarting", "draining"]

MAX_STOP_TOKEN_IDS = 256  # stop token ids of one request
MAX_LOGPROBS = 20  # most likely tokens reported with each output token
MAX_LOGIT_BIAS = 300  # tokens one request may bias (OpenAI's limit)
MAX_BAD_WORDS = 128  # banned token sequences of one request (a word given as text: with and without a leading space)
MAX_BAD_WORD_TEXTS = 64  # bad words a client gives as text
MAX_BAD_WORD_CHARS = 256
MAX_BAD_WORD_TOKENS = 32  # tokens of one banned sequence
MAX_GRAMMAR_CHARS = 64 * 1024  # a structured output's schema, regex, choices or grammar, as text
# what a structured output's text is: a JSON schema ("json", "json_object": any object, its
# text empty), a regular expression, a JSON list of choices, or a grammar (Lark or GBNF)
GrammarKind = Literal["json", "json_object", "regex", "choice", "grammar"]


class Wire(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    pass


class Tagged(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True, tag=True):
    pass


class Grammar(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A structured output: every token the tail samples keeps the output inside it
    (kvasir/sched/grammar.py checks it, kvasir/stage/grammar.py applies it)."""

    kind: GrammarKind
    text: str = ""
