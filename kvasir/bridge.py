"""The bridge: clients' front door (asyncio on uvloop).

It tokenizes and validates submissions, hands them to the head, turns the tail's token
events into per-request events (text deltas, exactly one terminal event each) and
republishes every token on the PUB endpoint. It is never on the boundary path.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import uvloop
import zmq
import zmq.asyncio

from kvasir.detokenizer import IncrementalDetokenizer
from kvasir.errors import RequestError
from kvasir.logs import setup_logging
from kvasir.messages import (
    Accepted,
    BridgeMessage,
    Cancel,
    Cancelled,
    CancelRequest,
    ClientMessage,
    Command,
    BatchSpan,
    DaemonStats,
    Drained,
    Enqueue,
    ErrorEvent,
    Finished,
    Ready,
    RequestEnded,
    SampledToken,
    SamplingParams,
    StageStats,
    StatsQuery,
    StatsReply,
    Submit,
    Timings,
    TokenEvents,
    TokenOut,
    Usage,
    WorkerSettings,
)
from kvasir.model.source import resolve_source
from kvasir.transport import BatchedSocket, Endpoints, make_socket
from kvasir.validation import check_prompt, check_sampling


MAX_CLIENT_MESSAGE = 16 * 1024 * 1024  # a client sending more is disconnected by ZMQ
TIMELINE_SPANS = 4096  # recent batch spans kept per stage for timelines (kvasir bench --plot)
PUB_QUEUE = 1_000_000  # token events queued per `kvasir tail` subscriber before it misses some


@dataclass
class Pending:
    """A request the bridge has accepted and not yet ended."""

    identity: bytes
    key: int
    prompt_tokens: int
    submitted_ns: int
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    scheduled_ns: int = 0
    first_ns: int = 0
    last_ns: int = 0


def load_tokenizer(folder: Path | None):
    """The model folder's tokenizer, or None when it has none (token ids only)."""
    if folder is None or not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


class Bridge:
    def __init__(self, settings: WorkerSettings, ctx: zmq.asyncio.Context, log) -> None:
        plan = settings.plan
        ends = Endpoints(settings.runtime_dir)
        source = resolve_source(plan.model.source)
        self.log = log
        self.vocab_size = source.vocab_size
        self.max_seq_len = plan.model.max_seq_len
        self.max_waiting = plan.bridge.max_waiting
        self.tokenizer = load_tokenizer(source.weights_dir)
        # the client endpoints are bound on "serve", once every stage is ready: a
        # client.sock in the runtime dir means the daemon is serving
        self.clients = make_socket(ctx, zmq.ROUTER)
        self.clients.setsockopt(zmq.MAXMSGSIZE, MAX_CLIENT_MESSAGE)
        # a ROUTER drops messages to a peer whose queue is full: never lose a client's
        # events (requests in the daemon are bounded by bridge.max_waiting)
        self.clients.setsockopt(zmq.SNDHWM, 0)
        self.publisher = make_socket(ctx, zmq.PUB)
        self.publisher.setsockopt(zmq.SNDHWM, PUB_QUEUE)
        self.ends = ends
        self.inbox = make_socket(ctx, zmq.PULL, bind=ends.bridge_in)
        self.commands = make_socket(ctx, zmq.PULL, bind=ends.command("bridge"))
        self.head = make_socket(ctx, zmq.PUSH, connect=ends.stage_in(0))
        self.control = make_socket(ctx, zmq.PUSH, connect=ends.control)
        self.client_io, self.publisher_io = BatchedSocket(self.clients), BatchedSocket(self.publisher)
        self.inbox_io, self.head_io = BatchedSocket(self.inbox), BatchedSocket(self.head)
        self.encoder = msgspec.msgpack.Encoder()
        self.client_decoder = msgspec.msgpack.Decoder(ClientMessage)
        self.inbox_decoder = msgspec.msgpack.Decoder(BridgeMessage)
        self.pending: dict[int, Pending] = {}
        self.stage_stats: dict[int, StageStats] = {}
        self.timelines: dict[int, deque[BatchSpan]] = {}
        self.started = time.monotonic()
        self.accepted = 0
        self.tokens_out = 0
        self.next_id = 1
        self.draining = False
        self.drained_sent = False
        self.stopped = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    # -- serving -----------------------------------------------------------------------
    async def serve(self) -> None:
        await self.control.send(self.encoder.encode(Ready("bridge", 0, os.getpid())))
        self._tasks = [asyncio.create_task(coro) for coro in (self._stages(), self._commands())]
        stopped = asyncio.create_task(self.stopped.wait())
        try:
            while not self.stopped.is_set():
                done, _ = await asyncio.wait([*self._tasks, stopped], return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if task is not stopped and not task.cancelled() and task.exception() is not None:
                        raise task.exception()  # a broken loop is fatal: the launcher sees us exit
        finally:
            for task in [*self._tasks, stopped]:
                task.cancel()
            await asyncio.gather(*self._tasks, stopped, return_exceptions=True)

    async def _clients(self) -> None:
        while True:
            for frames in await self.client_io.recv_batch(multipart=True):
                await self._client_message(frames)

    async def _client_message(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            if frames:
                await self._send(frames[0], ErrorEvent(code="invalid_request", message=f"expected one frame, got {len(frames) - 1}"))
            return
        identity, body = frames
        try:
            message = self.client_decoder.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            await self._send(identity, ErrorEvent(code="invalid_request", message=f"malformed message: {exc}"))
            return
        match message:
            case Submit():
                await self._submit(identity, message)
            case Cancel(request_id=rid):
                await self._cancel(identity, rid)
            case StatsQuery(key=key, timeline=timeline):
                await self._send(identity, StatsReply(key=key, stats=self.daemon_stats(timeline)))

    async def _submit(self, identity: bytes, msg: Submit) -> None:
        try:
            if self.draining:
                raise RequestError("shutting_down", "the daemon is shutting down and takes no new requests")
            if len(self.pending) >= self.max_waiting:
                raise RequestError("overloaded", f"{len(self.pending)} requests are already waiting or running")
            ids = self._prompt_ids(msg)
            sampling = SamplingParams(
                temperature=msg.temperature,
                top_p=msg.top_p,
                top_k=msg.top_k,
                seed=msg.seed,
                max_tokens=msg.max_tokens,
                stop_token_ids=tuple(msg.stop_token_ids),
                ignore_eos=msg.ignore_eos,
            )
            check_sampling(sampling, self.vocab_size)
        except RequestError as exc:
            await self._send(identity, ErrorEvent(code=exc.code, message=exc.message, key=msg.key))
            return
        rid = self.next_id
        self.next_id += 1
        self.accepted += 1
        detok = IncrementalDetokenizer(self.tokenizer) if self.tokenizer is not None else None
        self.pending[rid] = Pending(identity, msg.key, len(ids), time.monotonic_ns(), detok)
        await self._send(identity, Accepted(key=msg.key, request_id=rid))
        await self.head_io.send(self.encoder.encode(Enqueue(rid, tuple(ids), sampling)))

    def _prompt_ids(self, msg: Submit) -> list[int]:
        if (msg.prompt is None) == (msg.token_ids is None):
            raise RequestError("invalid_request", "give exactly one of prompt (text) or token_ids")
        if msg.token_ids is not None:
            return check_prompt(msg.token_ids, self.vocab_size, self.max_seq_len)
        if self.tokenizer is None:
            raise RequestError("invalid_request", "this model has no tokenizer: submit token ids instead of text")
        if msg.chat:
            if not getattr(self.tokenizer, "chat_template", None):
                raise RequestError("invalid_request", "this model has no chat template")
            ids = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": msg.prompt}], add_generation_prompt=True, tokenize=True
            )
            ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        else:
            ids = self.tokenizer.encode(msg.prompt, add_special_tokens=True)
        return check_prompt(ids, self.vocab_size, self.max_seq_len)

    async def _cancel(self, identity: bytes, rid: int) -> None:
        record = self.pending.get(rid)
        if record is None or record.identity != identity:
            await self._send(
                identity, ErrorEvent(code="unknown_request", message=f"no running request {rid} of yours", request_id=rid)
            )
            return
        await self.head_io.send(self.encoder.encode(CancelRequest(rid)))

    async def _stages(self) -> None:
        while True:
            for body in await self.inbox_io.recv_batch():
                await self._stage_message(self.inbox_decoder.decode(body))
            await self._maybe_drained()

    async def _stage_message(self, message: BridgeMessage) -> None:
        match message:
            case TokenEvents(tokens=tokens):
                for token in tokens:
                    await self._token(token)
            case RequestEnded(request_id=rid, code=code, message=text):
                record = self.pending.pop(rid, None)
                if record is not None:
                    event = Cancelled(request_id=rid) if code == "cancelled" else ErrorEvent(code=code, message=text, request_id=rid)
                    await self._send(record.identity, event)
            case StageStats() as stats:
                self.timelines.setdefault(stats.index, deque(maxlen=TIMELINE_SPANS)).extend(stats.spans)
                self.stage_stats[stats.index] = msgspec.structs.replace(stats, spans=())

    async def _token(self, token: SampledToken) -> None:
        record = self.pending.get(token.request_id)
        if record is None:
            return
        now = time.monotonic_ns()
        if not record.token_ids:
            record.first_ns = now
            record.scheduled_ns = token.scheduled_ns
        record.last_ns = now
        record.token_ids.append(token.token_id)
        self.tokens_out += 1
        text = ""
        if record.detokenizer is not None:
            text = record.detokenizer.push(token.token_id)
            if token.finish is not None:
                text += record.detokenizer.flush()
        event = TokenOut(request_id=token.request_id, index=token.index, token_id=token.token_id, text=text)
        encoded = self.encoder.encode(event)
        await self.publisher_io.send(encoded)
        await self.client_io.send_multipart([record.identity, encoded])
        if token.finish is not None:
            del self.pending[token.request_id]
            await self._send(record.identity, self._finished(token.request_id, token.finish, record))

    def _finished(self, rid: int, reason: str, r: Pending) -> Finished:
        n = len(r.token_ids)
        return Finished(
            request_id=rid,
            reason=reason,
            token_ids=r.token_ids,
            usage=Usage(prompt_tokens=r.prompt_tokens, completion_tokens=n),
            timings=Timings(
                queued_s=max(0, r.scheduled_ns - r.submitted_ns) / 1e9,
                first_token_s=(r.first_ns - r.submitted_ns) / 1e9,
                per_token_s=(r.last_ns - r.first_ns) / 1e9 / (n - 1) if n > 1 else 0.0,
                total_s=(r.last_ns - r.submitted_ns) / 1e9,
            ),
        )

    async def _commands(self) -> None:
        decoder = msgspec.msgpack.Decoder(Command)
        while True:
            command = decoder.decode(await self.commands.recv())
            if command.kind == "serve":
                self.publisher.bind(self.ends.events)
                self.clients.bind(self.ends.client)
                self._tasks.append(asyncio.create_task(self._clients()))
                self.log.info("accepting clients")
            elif command.kind == "drain":
                self.draining = True
                self.log.info("draining", requests=len(self.pending))
                await self._maybe_drained()
            elif command.kind == "stop":
                reason = "a stage failed" if command.code == "stage_failed" else "the daemon stopped"
                await self._end_all(command.code, f"{reason} before the request finished")
                self.clients.setsockopt(zmq.LINGER, 2000)  # let those last events reach their clients
                self.stopped.set()

    async def _maybe_drained(self) -> None:
        if self.draining and not self.pending and not self.drained_sent:
            self.drained_sent = True
            await self.control.send(self.encoder.encode(Drained()))

    async def _end_all(self, code: str, message: str) -> None:
        for rid, record in list(self.pending.items()):
            await self._send(record.identity, ErrorEvent(code=code, message=message, request_id=rid))
        self.pending.clear()

    async def _send(self, identity: bytes, event) -> None:
        await self.client_io.send_multipart([identity, self.encoder.encode(event)])

    def daemon_stats(self, timeline: bool = False) -> DaemonStats:
        order = sorted(self.stage_stats)
        return DaemonStats(
            uptime_s=time.monotonic() - self.started,
            requests=self.accepted,
            in_flight=len(self.pending),
            tokens_out=self.tokens_out,
            waiting_limit=self.max_waiting,
            vocab_size=self.vocab_size,
            max_seq_len=self.max_seq_len,
            stages=[self.stage_stats[k] for k in order],
            timeline=[list(self.timelines.get(k, ())) for k in order] if timeline else [],
        )


def run_bridge(encoded: bytes) -> None:
    """Entry point of the bridge process (spawned by the launcher)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)  # the launcher owns shutdown (a group-wide signal must not kill us)
    settings = msgspec.msgpack.decode(encoded, type=WorkerSettings)
    log = setup_logging(settings.log_level, role="bridge", pid=os.getpid())

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        try:
            bridge = Bridge(settings, ctx, log)
            watch = asyncio.create_task(_watch_launcher(settings.launcher_pid, bridge, log))
            log.info("bridge ready")
            await bridge.serve()
            watch.cancel()
        finally:
            ctx.destroy()

    try:
        uvloop.run(main())
    except Exception:
        log.exception("bridge failed")
        raise SystemExit(1)
    log.info("bridge stopped")


async def _watch_launcher(launcher_pid: int, bridge: Bridge, log) -> None:
    while os.getppid() == launcher_pid:
        await asyncio.sleep(0.2)
    log.warning("launcher is gone; stopping")
    bridge.stopped.set()
