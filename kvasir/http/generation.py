"""One HTTP request's generations: its prompts times ``n`` submitted to the bridge, their
events merged into ``Piece``s in arrival order, ``stop`` strings cut out of the text.

A request is answered (or its stream started) only once the bridge accepted every one of
its submissions: a refusal is then one HTTP error, and nothing of it keeps running. Every
submission still running when the generation closes (the client went away, or another
choice failed) is cancelled.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from kvasir.client import AsyncClient, RequestStream
from kvasir.errors import KvasirError
from kvasir.http.errors import ApiError
from kvasir.http.reading import Reader
from kvasir.http.schema import FinishReason
from kvasir.http.toolcalls import Parsed, ToolCall
from kvasir.wire.client import Accepted, Cancelled, ErrorEvent, Finished, PromptLogprobs, TokenOut

ANSWER_S = 5.0  # closing: how long to wait for the bridge's answer to a submission (to cancel it)
PIECES_QUEUED = 256  # pieces waiting for the handler: a full queue holds the pumps (and the client's events)


@dataclass(frozen=True)
class Submission:
    """One choice to generate: the prompt's ids and the client's ``submit`` keywords."""

    index: int  # the choice's index in the response
    prompt: list[int]
    options: dict[str, Any]


# a token, its log-probability and the most likely tokens' (None for a prompt's first token)
Score = tuple[int, float | None, list[tuple[int, float]] | None]


@dataclass(frozen=True)
class Piece:
    """Text for one choice; with ``finish`` its last; with ``error`` it failed; ``scores``:
    the log-probabilities of the tokens that arrived with it (when the request asked)."""

    index: int
    text: str
    finish: FinishReason = None
    error: ApiError | None = None
    scores: tuple[Score, ...] = ()
    prompt: bool = False  # the echoed prompt's log-probabilities (echo with logprobs), before any token
    calls: tuple[ToolCall, ...] = ()  # tool calls now complete (a request with tools)
    reasoning: str = ""  # a thinking model's reasoning ([http] reasoning = "think")


class StopText:
    """Finds stop strings in streamed text. Text that could be the start of a stop string
    is held back until the next delta shows it is not (it is never sent, then retracted)."""

    def __init__(self, stops: list[str], include: bool = False) -> None:
        self.stops = [stop for stop in stops if stop]
        self.include = include  # vLLM's include_stop_str_in_output: the stop string ends the text
        self.hold = max((len(stop) for stop in self.stops), default=1) - 1
        self.pending = ""

    def push(self, delta: str, armed: bool = True) -> tuple[str, bool]:
        """The text that can go out now, and whether a stop string ended the choice (not
        before ``armed``: vLLM's min_tokens holds stop strings off too)."""
        if not self.stops:
            return delta, False
        self.pending += delta
        found = self._find() if armed else None
        if found is not None:
            at, end = found
            out, self.pending = self.pending[: end if self.include else at], ""
            return out, True
        keep = len(self.pending) - self.hold
        if keep <= 0:
            return "", False
        out, self.pending = self.pending[:keep], self.pending[keep:]
        return out, False

    def _find(self) -> tuple[int, int] | None:
        """Where the first stop string in the pending text starts and ends (the longest starting there)."""
        hits = [(at, -len(stop)) for stop in self.stops if (at := self.pending.find(stop)) >= 0]
        if not hits:
            return None
        at, minus = min(hits)
        return at, at - minus

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


@dataclass
class Choice:
    submission: Submission
    stream: RequestStream
    events: AsyncIterator
    stops: StopText
    ids: list[int] = field(default_factory=list)  # output token ids so far
    scores: list[Score] = field(default_factory=list)  # their log-probabilities, when asked for
    prompt_scores: list[Score] = field(default_factory=list)  # the prompt's, with echo and logprobs
    ended: bool = False
    cached_tokens: int = 0  # of its prompt, reused from the prefix cache (known when it finished)
    reader: Reader | None = None  # reads reasoning and tool calls out of its text (chat)

    def read(self, text: str, end: bool = False) -> Parsed:
        """Its text as content, reasoning and tool calls (all content without a reader)."""
        return Parsed(text) if self.reader is None else self.reader.read(text, end)

    def finish(self, reason: FinishReason) -> FinishReason:
        """A choice that called tools and stopped ends with ``tool_calls``."""
        return "tool_calls" if self.reader is not None and self.reader.called and reason == "stop" else reason

    @property
    def scores_prompt(self) -> bool:
        return self.submission.options.get("prompt_logprobs") is not None

    def prompt_piece(self) -> Piece | None:
        """The prompt's scores as one piece, once every prompt token after the first has one."""
        prompt = self.submission.prompt
        if not self.scores_prompt or len(self.prompt_scores) != len(prompt) - 1:
            return None
        return Piece(self.submission.index, "", scores=((prompt[0], None, None), *self.prompt_scores), prompt=True)


@dataclass
class Generation:
    client: AsyncClient
    choices: list[Choice] = field(default_factory=list)

    @classmethod
    async def start(
        cls,
        client: AsyncClient,
        submissions: list[Submission],
        stops: list[str],
        tenant: str,
        include_stop: bool = False,
        reader: Callable[[], Reader | None] | None = None,
    ) -> Generation:
        """Submit every choice for ``tenant`` (whose prefix-cache namespace it is in) and
        wait until the bridge accepted them all (ApiError, with the accepted ones
        cancelled, when it refused one). ``reader``: a new reader of each choice's text (chat)."""
        generation = cls(client)
        try:
            for sub in submissions:
                stream = await client.submit(token_ids=sub.prompt, tenant=tenant, **sub.options)
                reading = reader() if reader is not None else None
                choice = Choice(sub, stream, aiter(stream), StopText(stops, include_stop), reader=reading)
                generation.choices.append(choice)
            for choice in generation.choices:
                first = await anext(choice.events)
                if isinstance(first, ErrorEvent):
                    choice.ended = True
                    raise ApiError(first.code, first.message)
                if not isinstance(first, Accepted):
                    raise ApiError("stage_failed", f"the daemon answered a submission with {type(first).__name__}")
        except BaseException:
            await generation.close()
            raise
        return generation

    @property
    def completion_tokens(self) -> int:
        return sum(len(choice.ids) for choice in self.choices)

    def cached_tokens(self, choices_per_prompt: int) -> int:
        """Prompt tokens the prefix cache supplied, each prompt counted once (as
        prompt_tokens counts it): the most any of its choices found cached."""
        best: dict[int, int] = {}
        for choice in self.choices:
            prompt = choice.submission.index // choices_per_prompt
            best[prompt] = max(best.get(prompt, 0), choice.cached_tokens)
        return sum(best.values())

    async def pieces(self) -> AsyncIterator[Piece]:
        """Every choice's pieces as they come, until each has its last (or failed)."""
        queue: asyncio.Queue[Piece] = asyncio.Queue(max(PIECES_QUEUED, len(self.choices)))
        for choice in self.choices:  # a one-token prompt's scores are complete already
            piece = choice.prompt_piece()
            if piece is not None:
                queue.put_nowait(piece)
        pumps = [asyncio.create_task(self._pump(choice, queue)) for choice in self.choices]
        try:
            left = len(self.choices)
            while left:
                piece = await queue.get()
                left -= piece.finish is not None or piece.error is not None
                yield piece
        finally:
            for pump in pumps:
                pump.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)

    async def close(self) -> None:
        """Cancel every submission still running."""
        for choice in self.choices:
            if not choice.ended:
                await self.close_one(choice)

    async def _pump(self, choice: Choice, queue: asyncio.Queue[Piece]) -> None:
        index = choice.submission.index
        try:
            async for event in choice.events:
                piece = await self._piece(choice, event)
                if piece is not None:
                    await queue.put(piece)
                if choice.ended:
                    return
            failure = ApiError("stage_failed", "the request's events ended early")
        except KvasirError as exc:  # the connection to the bridge failed
            failure = ApiError("stage_failed", str(exc))
        except Exception as exc:  # a bug: this request fails, the handler is not left waiting
            failure = ApiError("internal_error", f"reading the request's events failed: {type(exc).__name__}: {exc}")
        choice.ended = True
        await queue.put(Piece(index, "", error=failure))

    async def _piece(self, choice: Choice, event) -> Piece | None:
        index = choice.submission.index
        match event:
            case TokenOut(token_id=token, text=text, logprob=logprob, top_logprobs=top):
                choice.ids.append(token)
                scores: tuple[Score, ...] = () if logprob is None else ((token, logprob, top or []),)
                choice.scores.extend(scores)
                out, stopped = choice.stops.push(
                    text, len(choice.ids) >= choice.submission.options.get("min_tokens", 0)
                )
                said = choice.read(out, stopped)
                if stopped or (choice.reader is not None and choice.reader.done):  # a stop string; one call made
                    await self.close_one(choice)
                    return self._last(choice, said, "stop", scores)
                if said.content or said.reasoning or scores or said.calls:
                    return Piece(index, said.content, scores=scores, calls=tuple(said.calls), reasoning=said.reasoning)
                return None
            case PromptLogprobs(token_ids=ids, logprobs=logprobs, top_logprobs=tops):
                choice.prompt_scores.extend(zip(ids, logprobs, tops))
                return choice.prompt_piece()
            case Finished(reason=reason, usage=used):
                choice.ended = True
                choice.cached_tokens = used.cached_tokens
                return self._last(choice, choice.read(choice.stops.flush(), True), reason)
            case ErrorEvent(code=code, message=message):
                choice.ended = True
                return Piece(index, "", error=ApiError(code, message))
            case Cancelled():
                choice.ended = True
                return Piece(index, "", error=ApiError("stage_failed", "the daemon cancelled the request"))
        return None

    @staticmethod
    def _last(choice: Choice, said: Parsed, reason: FinishReason, scores: tuple[Score, ...] = ()) -> Piece:
        index, finish = choice.submission.index, choice.finish(reason)
        return Piece(index, said.content, finish, scores=scores, calls=tuple(said.calls), reasoning=said.reasoning)

    async def close_one(self, choice: Choice) -> None:
        """A choice ended here (a stop string, the client went away, a sibling was refused):
        cancel its request in the daemon, once the bridge's answer to it is in."""
        choice.ended = True
        rid = choice.stream.request_id
        if rid is None:  # the answer to its submission is still on its way
            try:
                first = await asyncio.wait_for(anext(choice.events), ANSWER_S)
            except (TimeoutError, StopAsyncIteration, KvasirError):
                return
            rid = first.request_id if isinstance(first, Accepted) else None
        if rid is not None:
            try:
                await self.client.cancel(rid)
            except KvasirError:
                pass  # the bridge is gone: nothing of the request runs any more
