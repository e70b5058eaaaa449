"""Client library: talk to a running kvasird over its ZMQ endpoints.

Submission is pipelined: ``submit`` sends and returns at once (no round trip), so one
client can submit thousands of requests a second; a background reader routes each
event to its request's stream. An error in the reader reaches every waiting caller.

    async with await AsyncClient.connect() as client:
        stream = await client.submit("Hello", max_tokens=16)
        async for event in stream:
            ...
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from kvasir.errors import KvasirError
from kvasir.messages import (
    Accepted,
    Cancel,
    Cancelled,
    ClientEvent,
    DaemonStats,
    ErrorEvent,
    Finished,
    StatsQuery,
    StatsReply,
    Submit,
    TokenOut,
)
from kvasir.transport import BatchedSocket, Endpoints, default_runtime_dir

TERMINAL = (Finished, Cancelled, ErrorEvent)


class NoDaemon(KvasirError):
    """Nothing answers at the runtime directory."""


class RequestStream:
    """The events of one request, in order: Accepted, TokenOut..., then one terminal event."""

    def __init__(self, key: int) -> None:
        self.key = key
        self.request_id: int | None = None
        self._queue: asyncio.Queue = asyncio.Queue()
        self.ended = False

    def _put(self, event: Any) -> None:
        self._queue.put_nowait(event)

    def __aiter__(self) -> AsyncIterator:
        return self._events()

    async def _events(self) -> AsyncIterator:
        while not self.ended:
            event = await self._queue.get()
            if isinstance(event, BaseException):
                self.ended = True
                raise event
            if isinstance(event, TERMINAL):
                self.ended = True
            yield event

    async def result(self) -> Finished | Cancelled | ErrorEvent:
        """Wait for the terminal event, skipping the rest."""
        last = None
        async for event in self:
            last = event
        return last


class AsyncClient:
    def __init__(self, runtime_dir: Path, ctx: zmq.asyncio.Context, sock: zmq.asyncio.Socket) -> None:
        self.runtime_dir = runtime_dir
        self._ctx = ctx
        self._sock = sock
        self._io = BatchedSocket(sock)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(ClientEvent)
        self._keys = itertools.count(1)
        self._by_key: dict[int, RequestStream] = {}
        self._by_id: dict[int, RequestStream] = {}
        self._stats: dict[int, asyncio.Future] = {}
        self._reader = asyncio.create_task(self._read())
        self._failure: BaseException | None = None

    @classmethod
    async def connect(cls, runtime_dir: str | Path | None = None, timeout_s: float = 5.0) -> "AsyncClient":
        """Connect and check that a daemon answers within ``timeout_s``; NoDaemon if not."""
        rt = Path(runtime_dir) if runtime_dir is not None else default_runtime_dir()
        ends = Endpoints(rt)
        if not ends.client_path.exists():
            raise NoDaemon(f"no kvasird is running at runtime dir {rt} (no {ends.client_path.name})")
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)  # events wait here until read, never dropped
        sock.connect(ends.client)
        client = cls(rt, ctx, sock)
        try:
            await asyncio.wait_for(client.stats(), timeout_s)
        except (asyncio.TimeoutError, KvasirError):
            await client.close()
            raise NoDaemon(f"no kvasird answers at runtime dir {rt}") from None
        return client

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def submit(
        self,
        prompt: str | None = None,
        *,
        token_ids: list[int] | None = None,
        chat: bool = False,
        max_tokens: int = 128,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop_token_ids: list[int] | None = None,
        ignore_eos: bool = False,
    ) -> RequestStream:
        """Send a request and return its stream at once (no reply awaited)."""
        self._raise_if_failed()
        key = next(self._keys)
        stream = RequestStream(key)
        self._by_key[key] = stream
        message = Submit(
            key=key,
            prompt=prompt,
            token_ids=token_ids,
            chat=chat,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            stop_token_ids=list(stop_token_ids or []),
            ignore_eos=ignore_eos,
        )
        await self._io.send(self._encoder.encode(message))
        return stream

    async def cancel(self, request_id: int) -> None:
        self._raise_if_failed()
        await self._io.send(self._encoder.encode(Cancel(request_id=request_id)))

    async def stats(self, timeline: bool = False, timeout_s: float = 10.0) -> DaemonStats:
        """The daemon's statistics; with ``timeline``, each stage's recent batch spans too.
        NoDaemon when no answer comes within ``timeout_s``."""
        self._raise_if_failed()
        key = next(self._keys)
        future = asyncio.get_running_loop().create_future()
        self._stats[key] = future
        await self._io.send(self._encoder.encode(StatsQuery(key=key, timeline=timeline)))
        try:
            return await asyncio.wait_for(future, timeout_s)
        except asyncio.TimeoutError:
            raise NoDaemon(f"kvasird at {self.runtime_dir} did not answer a stats query within {timeout_s:g} s") from None
        finally:
            self._stats.pop(key, None)

    async def close(self) -> None:
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)
        self._sock.close(linger=0)
        self._ctx.term()

    # -- reading ----------------------------------------------------------------------------
    async def _read(self) -> None:
        try:
            while True:
                for body in await self._io.recv_batch():
                    self._route(self._decoder.decode(body))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # deliver the failure to every waiting caller
            self._failure = exc
            for stream in [*self._by_key.values(), *self._by_id.values()]:
                stream._put(exc)
            for future in self._stats.values():
                if not future.done():
                    future.set_exception(exc)

    def _route(self, event) -> None:
        match event:
            case Accepted(key=key, request_id=rid):
                stream = self._by_key.pop(key, None)
                if stream is not None:
                    stream.request_id = rid
                    self._by_id[rid] = stream
                    stream._put(event)
            case StatsReply(key=key, stats=stats):
                future = self._stats.get(key)
                if future is not None and not future.done():
                    future.set_result(stats)
            case ErrorEvent(key=key, request_id=rid) if rid is None and key is not None:
                stream = self._by_key.pop(key, None)
                if stream is not None:
                    stream._put(event)
            case TokenOut(request_id=rid) | Finished(request_id=rid) | Cancelled(request_id=rid) | ErrorEvent(request_id=rid):
                stream = self._by_id.get(rid)
                if stream is not None:
                    stream._put(event)
                    if isinstance(event, TERMINAL):
                        del self._by_id[rid]

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise KvasirError(f"the connection to kvasird failed: {self._failure}")


class Client:
    """A thin synchronous wrapper: an AsyncClient on a private event-loop thread."""

    def __init__(self, runtime_dir: str | Path | None = None, timeout_s: float = 5.0) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvasir-client", daemon=True)
        self._thread.start()
        try:
            self._client = self._call(AsyncClient.connect(runtime_dir, timeout_s))
        except BaseException:
            self._stop_loop()
            raise

    def _call(self, coro):
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result()
        except BaseException:  # interrupted (Ctrl-C): do not leave the coroutine running
            future.cancel()
            raise

    def submit(self, prompt: str | None = None, **kw) -> RequestStream:
        return self._call(self._client.submit(prompt, **kw))

    def events(self, stream: RequestStream) -> Iterator:
        """Iterate a request's events from this thread."""
        iterator = stream.__aiter__()
        while True:
            try:
                yield self._call(iterator.__anext__())
            except StopAsyncIteration:
                return

    def generate(self, prompt: str | None = None, **kw) -> Finished | Cancelled | ErrorEvent:
        """Submit and wait for the terminal event."""
        stream = self.submit(prompt, **kw)
        return self._call(stream.result())

    def cancel(self, request_id: int) -> None:
        self._call(self._client.cancel(request_id))

    def stats(self, timeline: bool = False, timeout_s: float = 10.0) -> DaemonStats:
        return self._call(self._client.stats(timeline, timeout_s))

    def close(self) -> None:
        self._call(self._client.close())
        self._stop_loop()

    def _stop_loop(self) -> None:
        try:
            asyncio.run_coroutine_threadsafe(self._loop.shutdown_asyncgens(), self._loop).result(5)
        except Exception:
            pass  # best effort: the loop is going away either way
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
