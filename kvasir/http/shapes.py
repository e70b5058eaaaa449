"""How a generation reads in each API: completions (``text_completion``) and chat
(``chat.completion``), whole or as stream chunks, each encoded once with msgspec."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import msgspec

from kvasir.http.generation import Piece, Score
from kvasir.http.schema import (
    AssistantMessage,
    ChatChoice,
    ChatChunk,
    ChatChunkChoice,
    ChatCompletion,
    Completion,
    CompletionChoice,
    Delta,
    FinishReason,
    FunctionOut,
    PromptTokensDetails,
    ToolCallDelta,
    ToolCallOut,
    UsageBody,
)
from kvasir.http.toolcalls import ToolCall

encode = msgspec.json.encode


@dataclass(frozen=True)
class Out:
    """One choice of a whole response."""

    text: str
    finish: FinishReason
    ids: list[int] | None  # its token ids, when the request asked for them
    scores: list[Score]  # its tokens' log-probabilities, when the request asked for them
    calls: tuple[ToolCall, ...] = ()  # the tool calls it made
    reasoning: str | None = None  # a thinking model's reasoning (None: not split off)


def completion_logprobs(scores: Sequence[Score], text_of: Callable[[int], str], offset: int) -> dict[str, Any]:
    """The completions API's ``logprobs``: parallel lists, text offsets from ``offset``."""
    tokens = [text_of(token) for token, _, _ in scores]
    offsets = list(accumulate((len(text) for text in tokens[:-1]), initial=offset)) if tokens else []
    return {
        "tokens": tokens,
        "token_logprobs": [logprob for _, logprob, _ in scores],
        "top_logprobs": [_by_text(top, text_of) for _, _, top in scores],
        "text_offset": offsets,
    }


def _by_text(top: list[tuple[int, float]] | None, text_of: Callable[[int], str]) -> dict[str, float] | None:
    """Alternatives keyed by their text; two tokens with one text (bytes of a character
    split across tokens) keep the likelier one's value. None for a prompt's first token."""
    if top is None:
        return None
    named: dict[str, float] = {}
    for token, logprob in top:
        named.setdefault(text_of(token), logprob)
    return named


def chat_logprobs(scores: Sequence[Score], text_of: Callable[[int], str]) -> dict[str, Any]:
    """The chat API's ``logprobs``: one entry per token, each with its top alternatives."""

    def entry(token: int, logprob: float) -> dict[str, Any]:
        text = text_of(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [
            {**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in top or ()]}
            for t, lp, top in scores
            if lp is not None  # chat scores output tokens only: every one has a log-probability
        ]
    }


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> UsageBody:
    return UsageBody(
        prompt_tokens, completion_tokens, prompt_tokens + completion_tokens, PromptTokensDetails(cached_tokens)
    )


class CompletionShape:
    def __init__(
        self, model: str, text_of: Callable[[int], str], echoes: list[str] | None = None, echo_scored: bool = False
    ) -> None:
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.echo_scored = echo_scored  # echo with logprobs: the prompt's tokens are scored too
        self.created = int(time.time())
        self.model = model
        self.text_of = text_of  # a token's text, for logprobs
        self.echoes = echoes  # per choice: the prompt's text, when the request asked for echo
        self.offsets: dict[int, int] = {}  # per choice: text streamed so far (logprobs' text_offset)

    def opening(self, index: int) -> bytes | None:
        if not self.echoes or not self.echoes[index] or self.echo_scored:
            return None  # echo with logprobs: the prompt's text comes with its scores (chunk)
        return self._chunk([CompletionChoice(index, self.echoes[index], None, None)])

    def chunk(self, piece: Piece) -> bytes:
        logprobs = None
        text = self.echoes[piece.index] if piece.prompt and self.echoes else piece.text
        if piece.scores:
            offset = self.offsets.get(piece.index, 0)
            logprobs = completion_logprobs(piece.scores, self.text_of, offset)
            self.offsets[piece.index] = offset + sum(len(text) for text in logprobs["tokens"])
        return self._chunk([CompletionChoice(piece.index, text, logprobs, piece.finish)])

    def usage_chunk(self, body: UsageBody) -> bytes:
        return self._chunk([], body)

    def whole(self, outs: list[Out], body: UsageBody) -> bytes:
        echoes = self.echoes or [""] * len(outs)
        choices = [
            CompletionChoice(k, echoes[k] + out.text, self._whole_logprobs(out), out.finish, out.ids)
            for k, out in enumerate(outs)
        ]
        return self._chunk(choices, body)

    def _whole_logprobs(self, out: Out) -> dict[str, Any] | None:
        return completion_logprobs(out.scores, self.text_of, 0) if out.scores else None

    def _chunk(self, choices: list[CompletionChoice], body: UsageBody | None = None) -> bytes:
        return encode(Completion(self.id, self.created, self.model, choices, usage=body))


class ChatShape:
    def __init__(self, model: str, text_of: Callable[[int], str]) -> None:
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.text_of = text_of  # a token's text, for logprobs
        self.called: dict[int, int] = {}  # per choice: tool calls streamed so far (each delta's index)

    def opening(self, index: int) -> bytes | None:
        return self._chunk([ChatChunkChoice(index, Delta(role="assistant", content=""), None, None)])

    def chunk(self, piece: Piece) -> bytes:
        calls = None
        if piece.calls:
            first = self.called.get(piece.index, 0)
            self.called[piece.index] = first + len(piece.calls)
            calls = [
                ToolCallDelta(first + k, c.id, FunctionOut(c.name, c.arguments)) for k, c in enumerate(piece.calls)
            ]
        delta = Delta(content=piece.text or None, tool_calls=calls, reasoning_content=piece.reasoning or None)
        logprobs = chat_logprobs(piece.scores, self.text_of) if piece.scores else None
        return self._chunk([ChatChunkChoice(piece.index, delta, logprobs, piece.finish)])

    def usage_chunk(self, body: UsageBody) -> bytes:
        return self._chunk([], body)

    def whole(self, outs: list[Out], body: UsageBody) -> bytes:
        choices = [
            ChatChoice(k, self._message(out), self._logprobs(out.scores), out.finish, out.ids)
            for k, out in enumerate(outs)
        ]
        return encode(ChatCompletion(self.id, self.created, self.model, choices, body))

    @staticmethod
    def _message(out: Out) -> AssistantMessage:
        """The answer; with tool calls, its content is null where the model wrote none."""
        reasoning = msgspec.UNSET if out.reasoning is None else (out.reasoning or None)
        if not out.calls:
            return AssistantMessage(out.text, reasoning_content=reasoning)
        calls = [ToolCallOut(c.id, FunctionOut(c.name, c.arguments)) for c in out.calls]
        return AssistantMessage(out.text or None, tool_calls=calls, reasoning_content=reasoning)

    def _logprobs(self, scores: list[Score]) -> dict[str, Any] | None:
        return chat_logprobs(scores, self.text_of) if scores else None

    def _chunk(self, choices: list[ChatChunkChoice], body: UsageBody | None = None) -> bytes:
        return encode(ChatChunk(self.id, self.created, self.model, choices, usage=body))


Shape = CompletionShape | ChatShape
