"""The asyncio client: pipelined submission, a reader routing events to streams, a
watcher of the connection (kvasir/client/__init__.py says how to use it)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from pathlib import Path
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvasir.client.connection import CLOSE_LINGER_MS, LINK, REFUSED, NoDaemon, NotAuthorised, Remote, check_local
from kvasir.client.stream import TERMINAL, RequestStream
from kvasir.errors import KvasirError, RequestError
from kvasir.transport import envelopes
from kvasir.transport.channels import BatchedSocket, Endpoints, default_runtime_dir
from kvasir.transport.envelopes import MAX_BATCH
from kvasir.wire.client import (
    Accepted,
    Cancel,
    Cancelled,
    ClientEvent,
    DaemonStats,
    DrainHost,
    DrainStarted,
    ErrorEvent,
    Finished,
    Move,
    MoveStarted,
    MoveTarget,
    PromptLogprobs,
    StatsQuery,
    StatsReply,
    Submit,
    TokenOut,
)
from kvasir.wire.decoding import Decoder, Malformed


class AsyncClient:
    def __init__(self, runtime_dir: Path, ctx: zmq.asyncio.Context, sock: zmq.asyncio.Socket) -> None:
        self.runtime_dir = runtime_dir
        self._ctx = ctx
        self._sock = sock
        self._io = BatchedSocket(sock)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder: Decoder[ClientEvent] = Decoder(ClientEvent)
        self._keys = itertools.count(1)
        self._by_key: dict[int, RequestStream] = {}
        self._by_id: dict[int, RequestStream] = {}
        self._stats: dict[int, asyncio.Future] = {}
        self._outgoing: list[bytes] = []  # messages of this turn, sent together (kvasir/transport/envelopes.py)
        self._sender: asyncio.Task | None = None
        self._reader = asyncio.create_task(self._read())
        self._failure: BaseException | None = None
        self._monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | REFUSED | sum(LINK))
        self.link = "no connection was attempted"  # the last thing the connection did (see LINK)
        self._watcher = asyncio.create_task(self._watch())

    @classmethod
    async def connect(
        cls, runtime_dir: str | Path | None = None, timeout_s: float = 5.0, remote: Remote | None = None
    ) -> AsyncClient:
        """Connect (to the runtime dir's socket, or to ``remote``'s TCP endpoint) and check
        that a daemon answers within ``timeout_s``: NoDaemon if not, NotAuthorised when
        it refuses this client's key."""
        rt = Path(runtime_dir) if runtime_dir is not None else default_runtime_dir()
        where = remote.endpoint if remote is not None else f"runtime dir {rt}"
        ends = Endpoints(rt)
        if remote is None:
            check_local(rt, ends)
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)  # events wait here until read, never dropped
        client = cls(rt, ctx, sock)  # its connection monitor is attached before connecting: no event is missed
        try:
            if remote is not None:
                remote.configure(sock)
            sock.connect(remote.endpoint if remote is not None else ends.client)
        except (KvasirError, zmq.ZMQError) as exc:
            await client.close()
            raise NoDaemon(f"cannot connect to {where}: {exc}") from None
        try:
            await asyncio.wait_for(client.stats(), timeout_s)
        except NotAuthorised:
            await client.close()
            raise
        except (TimeoutError, KvasirError):
            await client.close()
            raise NoDaemon(f"no kvasird answers at {where} ({client.link} within {timeout_s:g} s)") from None
        return client

    async def __aenter__(self) -> AsyncClient:
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
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        cache_salt: str | None = None,
        tenant: str | None = None,
        session: str | None = None,
        **shaping: Any,
    ) -> RequestStream:
        """Send a request and return its stream at once (no reply awaited).

        ``cache_salt``: the request shares prefix-cache blocks only with requests of the
        same tenant giving the same salt. ``tenant``: a local client serving others (as the
        HTTP front does) names the caller whose cache namespace the request is in; the
        daemon refuses it from remote clients, whose tenant is their CURVE key. ``session``:
        a conversation's or a user's id; in a fleet its requests go to the instance its
        first one went to, while that instance serves (docs/fleet.md). ``shaping``: the
        logits' processing, vLLM's meanings: ``presence_penalty``, ``frequency_penalty``,
        ``repetition_penalty``, ``min_p``, ``logit_bias`` ({token id: bias}),
        ``min_tokens``, ``bad_words`` (texts), ``skip_special_tokens`` (kvasir/wire/client.py
        ``Submit``), and ``speculative`` (False: no drafts for it, docs/speculative.md); a
        name it does not have is a TypeError."""
        self._raise_if_failed()
        key = next(self._keys)
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
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            cache_salt=cache_salt,
            tenant=tenant,
            session=session,
            **shaping,
        )
        body = self._encode(message)  # a value msgpack cannot hold fails here, before a stream exists
        stream = RequestStream(key)
        self._by_key[key] = stream
        await self._post_encoded(body)
        return stream

    async def cancel(self, request_id: int) -> None:
        self._raise_if_failed()
        await self._post(Cancel(request_id=request_id))

    async def stats(self, timeline: bool = False, timeout_s: float = 10.0) -> DaemonStats:
        """The daemon's statistics; with ``timeline``, each stage's recent batch spans too.
        NoDaemon when no answer comes within ``timeout_s``."""
        return await self._keyed(StatsQuery(key=next(self._keys), timeline=timeline), timeout_s)

    async def move(self, instance: str, to: MoveTarget, timeout_s: float = 10.0) -> MoveStarted:
        """Move an instance to another pool (a plan with [planner], docs/planner.md): the
        bridge's word that the move started (it goes on in the daemon: watch ``stats()``'s
        instances); RequestError with the bridge's reason when it refuses."""
        reply = await self._keyed(Move(key=next(self._keys), instance=instance, to=to), timeout_s)
        if isinstance(reply, ErrorEvent):
            raise RequestError(reply.code, reply.message)
        return reply

    async def drain_host(self, host: str, timeout_s: float = 10.0) -> DrainStarted:
        """Drain a host (docs/planner.md): the bridge's word that its instances are leaving
        (they park once their requests finished: watch ``stats()``'s instances);
        RequestError with the bridge's reason when it refuses."""
        reply = await self._keyed(DrainHost(key=next(self._keys), host=host), timeout_s)
        if isinstance(reply, ErrorEvent):
            raise RequestError(reply.code, reply.message)
        return reply

    async def _keyed(self, message: StatsQuery | Move | DrainHost, timeout_s: float):
        """Send a message answered by one event with its key; NoDaemon when none comes."""
        self._raise_if_failed()
        future = asyncio.get_running_loop().create_future()
        self._stats[message.key] = future
        await self._post(message)
        try:
            return await asyncio.wait_for(future, timeout_s)
        except TimeoutError:
            what = {StatsQuery: "a stats query", Move: "a move", DrainHost: "a drain"}[type(message)]
            raise NoDaemon(f"kvasird at {self.runtime_dir} did not answer {what} within {timeout_s:g} s") from None
        finally:
            self._stats.pop(message.key, None)

    def _encode(self, message: Submit | Cancel | StatsQuery | Move | DrainHost) -> bytes:
        try:
            return self._encoder.encode(message)
        except (OverflowError, TypeError, ValueError) as exc:
            raise KvasirError(f"cannot send {type(message).__name__}: {exc}") from None

    async def _post(self, message: Submit | Cancel | StatsQuery | Move | DrainHost) -> None:
        await self._post_encoded(self._encode(message))

    async def _post_encoded(self, body: bytes) -> None:
        """Queue a message for the bridge: what is queued in one turn of the event loop
        leaves as one batch when the turn ends (at most MAX_BATCH messages each)."""
        self._outgoing.append(body)
        if len(self._outgoing) >= MAX_BATCH:
            batch, self._outgoing = self._outgoing, []
            await self._io.send(envelopes.join(batch))
        elif self._sender is None:
            self._sender = asyncio.create_task(self._send_turn())

    async def _send_turn(self) -> None:
        await asyncio.sleep(0)  # let the rest of this turn's messages join
        self._sender = None
        batch, self._outgoing = self._outgoing, []
        if not batch:
            return
        try:
            await self._io.send(envelopes.join(batch))
        except Exception as exc:  # the socket is gone: every caller hears of it
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        self._failure = exc
        for stream in [*self._by_key.values(), *self._by_id.values()]:
            stream._put(exc)
        for future in self._stats.values():
            if not future.done():
                future.set_exception(exc)

    def _decode(self, body: bytes) -> list:
        """The events of one body; one that does not decode fails every caller (the
        daemon speaks another version of the protocol, or something else answered)."""
        try:
            return [self._decoder.decode(member) for member in envelopes.members(body)]
        except (Malformed, envelopes.BatchError) as exc:
            self._fail(KvasirError(f"the daemon sent an event this client cannot read: {exc}"))
            return []

    async def close(self) -> None:
        if self._sender is not None:
            self._sender.cancel()
        linger = 0
        if self._outgoing:  # queued this turn (a cancel just before closing): it still leaves
            with contextlib.suppress(zmq.ZMQError):
                self._io.send_now([envelopes.join(self._outgoing)])
                linger = CLOSE_LINGER_MS
            self._outgoing = []
        for task in (self._reader, self._watcher):
            task.cancel()
        await asyncio.gather(self._reader, self._watcher, return_exceptions=True)
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=linger)
        self._ctx.term()

    # -- reading ----------------------------------------------------------------------------
    async def _read(self) -> None:
        try:
            while True:
                for body in await self._io.recv_batch():
                    for event in self._decode(body):
                        self._route(event)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # deliver the failure to every waiting caller
            self._fail(exc)

    async def _watch(self) -> None:
        try:
            await self._watch_link()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # deliver the failure to every waiting caller
            self._fail(exc)

    async def _watch_link(self) -> None:
        """When the connection to the bridge drops (it failed or stopped), route what had
        already arrived, then end every request still open with one ``stage_failed``
        error: nobody is left to finish it. ZMQ reconnects by itself, so later requests
        reach the bridge the launcher restarts."""
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())["event"]
            if event & REFUSED:
                self._refused()
                continue
            if event in LINK:
                self.link = LINK[event]
                continue
            try:
                while True:
                    for event in self._decode(self._io.shadow.recv(zmq.NOBLOCK)):
                        self._route(event)
            except zmq.Again:
                pass
            lost = ErrorEvent(code="stage_failed", message="lost the connection to kvasird before the request ended")
            for stream in [*self._by_key.values(), *self._by_id.values()]:
                stream._put(msgspec.structs.replace(lost, request_id=stream.request_id, key=stream.key))
            self._by_key.clear()
            self._by_id.clear()

    def _refused(self) -> None:
        """The daemon's endpoint refused the handshake: fail every caller, clearly."""
        self._fail(
            NotAuthorised("kvasird refused this client: no CURVE key, a key it does not allow, or the wrong server key")
        )

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
            case MoveStarted(key=key) | DrainStarted(key=key) | ErrorEvent(key=key) if key in self._stats:
                future = self._stats[key]
                if not future.done():
                    future.set_result(event)
            case ErrorEvent(key=key, request_id=rid) if rid is None and key is not None:
                stream = self._by_key.pop(key, None)
                if stream is not None:
                    stream._put(event)
            case (
                TokenOut(request_id=rid)
                | PromptLogprobs(request_id=rid)
                | Finished(request_id=rid)
                | Cancelled(request_id=rid)
                | ErrorEvent(request_id=rid)
            ):
                stream = self._by_id.get(rid) if rid is not None else None
                if stream is not None and rid is not None:
                    stream._put(event)
                    if isinstance(event, TERMINAL):
                        del self._by_id[rid]

    def _raise_if_failed(self) -> None:
        if isinstance(self._failure, NotAuthorised):
            raise self._failure  # the refusal may come before the first call: say so, not "no daemon"
        if self._failure is not None:
            raise KvasirError(f"the connection to kvasird failed: {self._failure}")
