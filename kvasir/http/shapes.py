"""How a generation reads in each API: completions (``text_completion``) and chat
(``chat.completion``), whole or as stream chunks, each encoded once with msgspec."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

import msgspec

from kvasir.http.generation import Piece
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
    UsageBody,
)

encode = msgspec.json.encode


@dataclass(frozen=True)
class Out:
    """One choice of a whole response."""

    text: str
    finish: FinishReason
    ids: list[int] | None  # its token ids, when the request asked for them


def usage(prompt_tokens: int, completion_tokens: int) -> UsageBody:
    return UsageBody(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens)


class CompletionShape:
    def __init__(self, model: str, echoes: list[str] | None = None) -> None:
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.echoes = echoes  # per choice: the prompt's text, when the request asked for echo

    def opening(self, index: int) -> bytes | None:
        if not self.echoes or not self.echoes[index]:
            return None
        return self._chunk([CompletionChoice(index, self.echoes[index], None, None)])

    def chunk(self, piece: Piece) -> bytes:
        return self._chunk([CompletionChoice(piece.index, piece.text, None, piece.finish)])

    def usage_chunk(self, body: UsageBody) -> bytes:
        return self._chunk([], body)

    def whole(self, outs: list[Out], body: UsageBody) -> bytes:
        echoes = self.echoes or [""] * len(outs)
        choices = [CompletionChoice(k, echoes[k] + out.text, None, out.finish, out.ids) for k, out in enumerate(outs)]
        return self._chunk(choices, body)

    def _chunk(self, choices: list[CompletionChoice], body: UsageBody | None = None) -> bytes:
        return encode(Completion(self.id, self.created, self.model, choices, usage=body))


class ChatShape:
    def __init__(self, model: str) -> None:
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model

    def opening(self, index: int) -> bytes | None:
        return self._chunk([ChatChunkChoice(index, Delta(role="assistant", content=""), None, None)])

    def chunk(self, piece: Piece) -> bytes:
        delta = Delta(content=piece.text) if piece.text else Delta()
        return self._chunk([ChatChunkChoice(piece.index, delta, None, piece.finish)])

    def usage_chunk(self, body: UsageBody) -> bytes:
        return self._chunk([], body)

    def whole(self, outs: list[Out], body: UsageBody) -> bytes:
        choices = [ChatChoice(k, AssistantMessage(out.text), None, out.finish, out.ids) for k, out in enumerate(outs)]
        return encode(ChatCompletion(self.id, self.created, self.model, choices, body))

    def _chunk(self, choices: list[ChatChunkChoice], body: UsageBody | None = None) -> bytes:
        return encode(ChatChunk(self.id, self.created, self.model, choices, usage=body))


Shape = CompletionShape | ChatShape
