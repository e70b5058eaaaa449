"""Checks at the engine's entry: a bad request gets a named error, never a torch crash."""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvasir.errors import RequestError
from kvasir.wire.base import (
    MAX_BAD_WORD_TOKENS,
    MAX_BAD_WORDS,
    MAX_GRAMMAR_CHARS,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_STOP_TOKEN_IDS,
    Grammar,
)
from kvasir.wire.batch import SamplingParams

MAX_SEED = 2**63 - 1
MAX_CHARS_PER_TOKEN = 64  # no tokenizer makes tokens longer than this on average
MAX_PENALTY = 2.0  # presence and frequency penalties: OpenAI's range, [-2, 2]
MAX_REPETITION_PENALTY = 10.0
MAX_BIAS = 100.0  # logit_bias values: OpenAI's range, [-100, 100]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_prompt(token_ids: Sequence[int], vocab_size: int, max_seq_len: int) -> list[int]:
    """Return the prompt as a list of ints, or raise RequestError. Lengths are checked
    before any id is looked at, so an oversized prompt costs nothing to refuse."""
    if isinstance(token_ids, (str, bytes)):
        raise RequestError("invalid_request", "prompt must be a list of token ids, not text")
    if not len(token_ids):
        raise RequestError("invalid_request", "prompt is empty: give at least one token")
    if len(token_ids) >= max_seq_len:
        raise RequestError(
            "too_long",
            f"prompt of {len(token_ids)} tokens leaves no room for output within max_seq_len = {max_seq_len}",
        )
    ids = list(token_ids)
    for index, tok in enumerate(ids):
        if not _is_int(tok) or not 0 <= tok < vocab_size:
            raise RequestError(
                "invalid_request",
                f"prompt token {index} = {tok!r} is not a token id of this model (0 <= id < {vocab_size})",
            )
    return ids


def check_prompt_text(text: str, max_seq_len: int) -> None:
    """Refuse, before tokenizing it, a text too long to fit ``max_seq_len`` tokens whatever
    the tokenizer does (tokenizing megabytes would stall the bridge for everyone)."""
    limit = max_seq_len * MAX_CHARS_PER_TOKEN
    if len(text) > limit:
        raise RequestError(
            "too_long",
            f"prompt text of {len(text)} characters cannot fit max_seq_len = {max_seq_len} tokens "
            f"(texts over {limit} characters are refused before tokenizing)",
        )


def check_max_tokens(max_tokens: int, ceiling: int) -> None:
    """A request's ``max_tokens`` within the plan's ``bridge.max_tokens_per_request``."""
    if _is_int(max_tokens) and max_tokens > ceiling:
        raise RequestError(
            "invalid_request",
            f"max_tokens = {max_tokens} is over this daemon's ceiling of {ceiling} (bridge.max_tokens_per_request)",
        )


def check_sampling(params: SamplingParams, vocab_size: int) -> None:
    """Raise RequestError for sampling parameters that are out of range or not finite."""
    t, p = params.temperature, params.top_p
    if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t) or t < 0:
        raise RequestError("invalid_request", f"temperature must be a finite number >= 0, got {t!r}")
    if not isinstance(p, (int, float)) or isinstance(p, bool) or not math.isfinite(p) or not 0 < p <= 1:
        raise RequestError("invalid_request", f"top_p must be a finite number in (0, 1], got {p!r}")
    if not _is_int(params.top_k) or params.top_k < 0:
        raise RequestError("invalid_request", f"top_k must be an integer >= 0 (0 = off), got {params.top_k!r}")
    if params.seed is not None and (not _is_int(params.seed) or not 0 <= params.seed <= MAX_SEED):
        raise RequestError("invalid_request", f"seed must be an integer in [0, 2**63), got {params.seed!r}")
    for name in ("ignore_eos", "speculative"):
        if not isinstance(getattr(params, name), bool):
            raise RequestError("invalid_request", f"{name} must be true or false, got {getattr(params, name)!r}")
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if not _is_int(value) or not -1 <= value <= MAX_LOGPROBS:
            raise RequestError("invalid_request", f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {value!r}")
    if not _is_int(params.max_tokens) or params.max_tokens < 1:
        raise RequestError("invalid_request", f"max_tokens must be an integer >= 1, got {params.max_tokens!r}")
    if len(params.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise RequestError(
            "invalid_request", f"at most {MAX_STOP_TOKEN_IDS} stop token ids, got {len(params.stop_token_ids)}"
        )
    for tok in params.stop_token_ids:
        if not _is_int(tok) or not 0 <= tok < vocab_size:
            raise RequestError(
                "invalid_request", f"stop token id {tok!r} is not a token id of this model (0 <= id < {vocab_size})"
            )
    check_shaping(params, vocab_size)


def _number_in(value: object, low: float, high: float) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and low <= value <= high
    )


def _token_in(tok: object, vocab_size: int) -> bool:
    return _is_int(tok) and 0 <= tok < vocab_size  # type: ignore[operator]


def check_shaping(params: SamplingParams, vocab_size: int) -> None:
    """Raise RequestError for penalties, ``min_p``, ``logit_bias``, ``min_tokens`` or bad
    words out of range (kvasir/stage/logits.py applies them)."""
    for name in ("presence_penalty", "frequency_penalty"):
        if not _number_in(getattr(params, name), -MAX_PENALTY, MAX_PENALTY):
            raise RequestError("invalid_request", f"{name} must be a number in [-2, 2], got {getattr(params, name)!r}")
    rep = params.repetition_penalty
    if not _number_in(rep, 0, MAX_REPETITION_PENALTY) or rep == 0:
        raise RequestError("invalid_request", f"repetition_penalty must be a number in (0, 10], got {rep!r}")
    if not _number_in(params.min_p, 0, 1):
        raise RequestError("invalid_request", f"min_p must be a number in [0, 1], got {params.min_p!r}")
    if not _is_int(params.min_tokens) or not 0 <= params.min_tokens <= params.max_tokens:
        raise RequestError(
            "invalid_request",
            f"min_tokens must be an integer in [0, max_tokens = {params.max_tokens}], got {params.min_tokens!r}",
        )
    if len(params.logit_bias) > MAX_LOGIT_BIAS:
        raise RequestError(
            "invalid_request", f"logit_bias biases at most {MAX_LOGIT_BIAS} tokens, got {len(params.logit_bias)}"
        )
    for tok, bias in params.logit_bias:
        if not _token_in(tok, vocab_size) or not _number_in(bias, -MAX_BIAS, MAX_BIAS):
            raise RequestError(
                "invalid_request",
                f"logit_bias {tok!r}: {bias!r} must be a token id of this model (0 <= id < {vocab_size}) "
                "and a bias in [-100, 100]",
            )
    _check_bad_words(params.bad_words, vocab_size)
    if params.grammar is not None:
        check_grammar_size(params.grammar)


def check_grammar_size(grammar: Grammar) -> None:
    if len(grammar.text) > MAX_GRAMMAR_CHARS:
        raise RequestError(
            "invalid_request",
            f"a structured output's text is at most {MAX_GRAMMAR_CHARS} characters, got {len(grammar.text)}",
        )


def _check_bad_words(words: tuple[tuple[int, ...], ...], vocab_size: int) -> None:
    if len(words) > MAX_BAD_WORDS:
        raise RequestError("invalid_request", f"at most {MAX_BAD_WORDS} bad words, got {len(words)}")
    for word in words:
        if not 1 <= len(word) <= MAX_BAD_WORD_TOKENS or not all(_token_in(tok, vocab_size) for tok in word):
            raise RequestError(
                "invalid_request",
                f"a bad word is 1 to {MAX_BAD_WORD_TOKENS} token ids of this model (0 <= id < {vocab_size}), got {word!r}",
            )
