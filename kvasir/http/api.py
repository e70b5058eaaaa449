"""The HTTP routes: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``,
``/tokenize``, ``/detokenize``, ``/version``, ``/health`` and ``/metrics`` (aiohttp). Every error is an OpenAI-shaped body; a stream
that fails after it started ends with an error event, then ``data: [DONE]``."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import TypeVar

import msgspec
from aiohttp import web

from kvasir.config.http import HttpSpec
from kvasir.http.callers import Callers
from kvasir.http.connections import Connections
from kvasir.http.errors import ApiError, from_validation, invalid
from kvasir.http.gateway import Gateway
from kvasir.http.generation import Generation
from kvasir.http.metrics import CONTENT_TYPE, render
from kvasir.http.prompts import Prompts
from kvasir.http.requests import Planned, Served, plan_chat, plan_completion
from kvasir.http.schema import ChatRequest, CompletionRequest, FinishReason, ModelCard, ModelList, UsageBody
from kvasir.http.shapes import ChatShape, CompletionShape, Out, Shape, usage
from kvasir.http.tokens import DetokenizeRequest, TokenizeRequest, Version, detokenize, tokenize
from kvasir.http.toolcalls import ToolCall
from kvasir.wire.decoding import JsonDecoder, Malformed

MAX_BODY = 32 * 1024 * 1024  # a request body (a prompt of max_seq_len token ids fits many times over)
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE = b"data: [DONE]\n\n"
# the request's caller: whose share it counts against (kvasir/http/callers.py), and, where
# there are API keys, whose prefix-cache namespace its prompts are in ("open" without keys)
CALLER = web.RequestKey("kvasir.caller", str)
T = TypeVar("T")
GUARDED = ("/v1/", "/tokenize", "/detokenize")  # paths behind the API keys
HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class Api:
    def __init__(
        self,
        gateway: Gateway,
        prompts: Prompts,
        served: Served,
        *,
        keys: frozenset[str] | None,
        http: HttpSpec,
        per_caller: int,
        log,
        kv_capacity: dict[int, int] | None = None,
    ) -> None:
        self.gateway = gateway
        self.prompts = prompts
        self.served = served
        self.limits = http
        self.kv_capacity = kv_capacity or {}  # each instance's KV blocks, by its head's stage (/metrics)
        self.callers = Callers(per_caller)
        self.connections: Connections | None = None  # set by the front once it serves (marks requests)
        self.stalled = 0  # streams cut off because their client stopped reading
        self.keys = frozenset(map(_digest, keys)) if keys is not None else None  # compared as digests
        self.log = log
        self.started = int(time.time())
        self.completion_decoder: JsonDecoder[CompletionRequest] = JsonDecoder(CompletionRequest)
        self.chat_decoder: JsonDecoder[ChatRequest] = JsonDecoder(ChatRequest)
        self.tokenize_decoder: JsonDecoder[TokenizeRequest] = JsonDecoder(TokenizeRequest)
        self.detokenize_decoder: JsonDecoder[DetokenizeRequest] = JsonDecoder(DetokenizeRequest)
        self.tokenizing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")

    def app(self) -> web.Application:
        @web.middleware
        async def errors(request: web.Request, handler) -> web.StreamResponse:
            return await self._errors(request, handler)

        @web.middleware
        async def auth(request: web.Request, handler) -> web.StreamResponse:
            return await self._auth(request, handler)

        app = web.Application(middlewares=[errors, auth], client_max_size=MAX_BODY)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/version", self.version)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        return app

    # -- middleware -------------------------------------------------------------------------
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        connections, transport = self.connections, request.transport
        if connections is not None:
            connections.busy(transport)
        try:
            if request.headers.get("Content-Encoding", "identity").strip().lower() != "identity":
                raise ApiError(
                    "unsupported_media_type",
                    "compressed request bodies are not accepted (Content-Encoding): send the body as it is",
                )
            return await handler(request)
        except ApiError as exc:
            return _error_response(exc)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            code = HTTP_CODES.get(exc.status, "invalid_request")
            return _error_response(ApiError(code, f"{request.method} {request.path}: {exc.reason}"))
        finally:
            if connections is not None:
                connections.idle(transport)

    async def _auth(self, request: web.Request, handler) -> web.StreamResponse:
        """Bearer keys guard /v1/, /tokenize and /detokenize (``http.api_keys``); /health,
        /metrics and /version stay open, as in vLLM."""
        if self.keys is not None and request.path.startswith(GUARDED):
            scheme, _, key = request.headers.get("Authorization", "").partition(" ")
            digest = _digest(key.strip())
            if scheme.lower() != "bearer" or digest not in self.keys:
                raise ApiError("invalid_api_key", "missing or wrong API key (Authorization: Bearer KEY)")
            request[CALLER] = "key:" + digest.hex()
        else:
            request[CALLER] = f"address:{request.remote}"
        return await handler(request)

    # -- routes -----------------------------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        card = ModelCard(self.served.model_name, self.started, self.served.max_seq_len)
        return _json(msgspec.json.encode(ModelList([card])))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        req = await self._decode(request, self.completion_decoder)
        planned, echoes = await self._off_loop(self._plan_completion, req)
        shape = CompletionShape(
            self.served.model_name, self.prompts.token_text, echoes, req.echo and req.logprobs is not None
        )
        include = req.stream_options is not None and req.stream_options.include_usage
        return await self._serve(request, planned, shape, req.stream, include, req.return_token_ids)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        req = await self._decode(request, self.chat_decoder)
        planned = await self._off_loop(plan_chat, req, self.prompts, self.served)
        include = req.stream_options is not None and req.stream_options.include_usage
        shape = ChatShape(self.served.model_name, self.prompts.token_text)
        return await self._serve(request, planned, shape, req.stream, include, req.return_token_ids)

    async def tokenize(self, request: web.Request) -> web.Response:
        req = await self._decode(request, self.tokenize_decoder)
        answer = await self._off_loop(tokenize, req, self.prompts, self.served.model_name)
        return _json(msgspec.json.encode(answer))

    async def detokenize(self, request: web.Request) -> web.Response:
        req = await self._decode(request, self.detokenize_decoder)
        answer = await self._off_loop(detokenize, req, self.prompts, self.served.model_name)
        return _json(msgspec.json.encode(answer))

    async def version(self, request: web.Request) -> web.Response:
        return _json(msgspec.json.encode(Version()))

    async def health(self, request: web.Request) -> web.Response:
        state = self.gateway.health()
        if state == "serving":
            return _json(b'{"status":"serving"}')
        return _json(msgspec.json.encode({"status": state}), 503, {"Retry-After": "5"})

    async def metrics(self, request: web.Request) -> web.Response:
        stats = await self.gateway.stats()
        body = render(stats, self.served.model_name, self.limits.metrics_prefix, self.kv_capacity)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})

    # -- generating -------------------------------------------------------------------------
    def _plan_completion(self, req: CompletionRequest) -> tuple[Planned, list[str] | None]:
        planned = plan_completion(req, self.prompts, self.served)
        if not req.echo:
            return planned, None
        texts = [p.text if p.text is not None else self.prompts.decode(p.ids) for p in planned.prompts]
        return planned, [texts[s.index // req.n] for s in planned.submissions]

    async def _off_loop(self, work: Callable[..., T], *args) -> T:
        """Tokenizing (up to 32 MiB of text) on the front's tokenizer thread: the loop
        keeps serving every other connection meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenizing, work, *args)

    def close(self) -> None:
        self.tokenizing.shutdown(wait=False, cancel_futures=True)

    async def _decode(self, request: web.Request, decoder):
        try:
            async with asyncio.timeout(self.limits.body_timeout_s):
                body = await request.read()
        except TimeoutError:
            raise ApiError(
                "request_timeout", f"the request body did not arrive within {self.limits.body_timeout_s:g} s"
            ) from None
        try:
            return decoder.decode(body)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise from_validation(exc) from None
        except Malformed as exc:
            raise invalid(f"the body cannot be read: {exc}") from None

    async def _serve(
        self, request: web.Request, planned: Planned, shape: Shape, stream: bool, include_usage: bool, ids: bool
    ) -> web.StreamResponse:
        caller = request[CALLER]
        tenant = caller if self.keys is not None else "open"  # without keys, one tenant: nobody is told apart
        with self.callers.share(caller, len(planned.submissions)):
            generation = await Generation.start(
                await self.gateway.client(),
                planned.submissions,
                planned.stops,
                tenant,
                planned.include_stop,
                planned.reader,
            )
            try:
                if stream:
                    return await self._stream(request, generation, shape, planned, include_usage)
                return await self._whole(generation, shape, planned, ids)
            finally:
                await generation.close()  # whatever still runs (the client went away, it stopped reading): cancelled

    async def _whole(self, generation: Generation, shape: Shape, planned: Planned, ids: bool) -> web.Response:
        count = len(planned.submissions)
        texts: list[list[str]] = [[] for _ in range(count)]
        calls: list[list[ToolCall]] = [[] for _ in range(count)]
        thoughts: list[list[str]] = [[] for _ in range(count)]
        finishes: list[FinishReason] = [None] * count
        async for piece in generation.pieces():
            if piece.error is not None:
                raise piece.error
            texts[piece.index].append(piece.text)
            calls[piece.index].extend(piece.calls)
            thoughts[piece.index].append(piece.reasoning)
            if piece.finish is not None:
                finishes[piece.index] = piece.finish
        outs = [
            Out(
                "".join(texts[k]),
                finishes[k],
                choice.ids if ids else None,
                self._scores(choice),
                tuple(calls[k]),
                "".join(thoughts[k]) if planned.thinking is not None else None,  # split off: the plan's choice
            )
            for k, choice in enumerate(generation.choices)
        ]
        return _json(shape.whole(outs, _usage(planned, generation)))

    @staticmethod
    def _scores(choice) -> list:
        """A choice's log-probabilities: with echo, its prompt's first."""
        prompt = choice.prompt_piece() if choice.scores_prompt else None
        return [*(prompt.scores if prompt is not None else ()), *choice.scores]

    async def _stream(
        self, request: web.Request, generation: Generation, shape: Shape, planned: Planned, include_usage: bool
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)
        write = partial(self._write, request, response)
        for index in range(len(planned.submissions)):
            opening = shape.opening(index)
            if opening is not None:
                await write(_event(opening))
        failed = False
        async for piece in generation.pieces():
            if piece.error is not None:
                await write(_event(piece.error.body()))
                failed = True
                break
            if piece.text or piece.reasoning or piece.scores or piece.calls or piece.finish is not None:
                await write(_event(shape.chunk(piece)))
        if include_usage and not failed:
            await write(_event(shape.usage_chunk(_usage(planned, generation))))
        await write(DONE)
        await response.write_eof()
        return response

    async def _write(self, request: web.Request, response: web.StreamResponse, data: bytes) -> None:
        """One chunk of a stream; a client that does not take it within http.write_timeout_s
        loses the connection, and its request is cancelled."""
        try:
            async with asyncio.timeout(self.limits.write_timeout_s):
                await response.write(data)
        except TimeoutError:
            self.stalled += 1
            self.log.warning(
                "the client stopped reading its stream: connection dropped, request cancelled",
                write_timeout_s=self.limits.write_timeout_s,
                stalled=self.stalled,
            )
            if request.transport is not None:
                request.transport.abort()
            raise ConnectionResetError(
                f"the client took no data for {self.limits.write_timeout_s:g} s (http.write_timeout_s)"
            ) from None


def _usage(planned: Planned, generation: Generation) -> UsageBody:
    cached = generation.cached_tokens(planned.choices_per_prompt)
    return usage(planned.prompt_tokens, generation.completion_tokens, cached)


def _event(body: bytes) -> bytes:
    return b"data: " + body + b"\n\n"


def _json(body: bytes, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=body, status=status, content_type="application/json", headers=headers)


def _error_response(exc: ApiError) -> web.Response:
    return _json(exc.body(), exc.status, exc.headers)
