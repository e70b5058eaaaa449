"""The bridge: clients' front door (asyncio on uvloop).

It tokenizes and validates submissions, hands them to the head, turns the tail's token
events into per-request events (text deltas, exactly one terminal event each) and
republishes every token on the PUB endpoint. It is never on the boundary path.
"""

from __future__ import annotations

import asyncio
import os
import time
from functools import partial
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator

from kvasir.bridge.detokenizer import detokenizer, load_tokenizer
from kvasir.bridge.heads import Heads
from kvasir.bridge.ledger import HandoffLog, Ledger, Peer, Pending
from kvasir.bridge.metrics import Metrics
from kvasir.bridge.moves import Moves
from kvasir.bridge.outbox import Outbox
from kvasir.bridge.reports import Reports
from kvasir.bridge.sockets import client_router, remote_router
from kvasir.bridge.stats import daemon_stats
from kvasir.bridge.streams import Streams
from kvasir.bridge.submissions import LOCAL, Submissions
from kvasir.errors import RequestError
from kvasir.tasks import Supervised
from kvasir.transport import envelopes
from kvasir.transport.channels import BatchedSocket, make_socket
from kvasir.transport.fabric import Sockets, open_fabric
from kvasir.wire.bridge import (
    BridgeMessage,
    HandoffReport,
    PoolEvents,
    PrefixEvents,
    RequestEnded,
    Retired,
    ShardStats,
    StageStats,
    TokenEvents,
)
from kvasir.wire.client import (
    Accepted,
    Cancel,
    Cancelled,
    ClientMessage,
    DrainHost,
    ErrorEvent,
    Move,
    StatsQuery,
    StatsReply,
    Submit,
)
from kvasir.wire.control import BridgeSettings, Command, Drained, Heartbeat, Ready, Regroup
from kvasir.wire.decoding import Decoder, Malformed
from kvasir.wire.head import CancelRequest, Enqueue, Retire

PUB_QUEUE = 100_000  # token events queued per `kvasir tail` subscriber before it misses some


class Bridge:
    def __init__(self, settings: BridgeSettings, ctx: zmq.asyncio.Context, log) -> None:
        plan = settings.plan
        ends, fabric = open_fabric(settings.runtime_dir, settings.fabric)
        model = settings.model
        if model is None:
            raise RuntimeError("the launcher sent the bridge no model facts")
        self.log = log
        self.vocab_size = model.vocab_size
        self.max_seq_len = plan.model.max_seq_len
        self.max_waiting = plan.bridge.max_waiting
        self.max_per_client = plan.bridge.max_per_client
        self.tokenizer = load_tokenizer(
            Path(model.folder) if model.folder is not None else None, plan.model.chat_template
        )
        self.submissions = Submissions(
            self.tokenizer,
            model.vocab_size,
            plan.model.max_seq_len,
            plan.bridge.max_tokens_per_request,
            plan.rings()[0].plan.kv.prefix_share,  # the pool whose heads admit requests (and cache prompts)
        )
        # the client endpoints are bound on "serve", once every stage is ready: a
        # client.sock in the runtime dir means the daemon is serving
        self.outbox = Outbox(plan.bridge.max_client_queue, plan.bridge.max_client_bytes, self._lost)
        self.clients = client_router(ctx)
        self.publisher = make_socket(ctx, zmq.PUB)
        self.publisher.setsockopt(zmq.SNDHWM, PUB_QUEUE)
        self.ends = ends
        self.tcp = plan.bridge.tcp
        authenticator: AsyncioAuthenticator | None = None
        self.remote_io: BatchedSocket | None = None
        if self.tcp is not None:
            self.remote_io, authenticator = remote_router(ctx, plan.bridge)
        self.sockets = Sockets(ctx, ends, fabric, authenticator)  # ends the context (and its ZAP handler)
        self.remote_curve = authenticator is not None
        for sock in (self.clients, self.publisher, *([self.remote_io.socket] if self.remote_io else [])):
            self.sockets.keep(sock)
        self.inbox = self.sockets.bind(zmq.PULL, ends.bridge_in)
        self.commands = self.sockets.bind(zmq.PULL, ends.command("bridge"))
        self.control = self.sockets.connect(zmq.PUSH, ends.control)
        self.client_io, self.publisher_io = BatchedSocket(self.clients), BatchedSocket(self.publisher)
        self.inbox_io = BatchedSocket(self.inbox)
        self.ctx = ctx
        self.heads = Heads(plan, self.sockets, model.kv_bytes_per_token)
        self.moves = Moves(self.heads, log, plan.planner)  # instances moving between pools, hosts draining
        self.stats_interval_s = settings.stats_interval_s
        self.encoder = msgspec.msgpack.Encoder()
        self.client_decoder: Decoder[ClientMessage] = Decoder(ClientMessage)
        self.inbox_decoder: Decoder[BridgeMessage] = Decoder(BridgeMessage)
        self.malformed = 0  # internal messages that did not decode (dropped)
        self.clients_lost = 0
        self.internal_errors = 0  # client messages whose handling raised (logged with their traceback)
        conductor = self.heads.conductor
        self.requests = Ledger(
            ended=lambda record: conductor.ended(record.instance, record.backlog, record.decode),
            started=self.heads.first_token,
        )
        self.handoffs = HandoffLog()
        self.metrics = Metrics(plan.model.max_seq_len)
        samples = self.moves.auto.samples if self.moves.auto is not None else None
        self.streams = Streams(self.requests, self.metrics, self.outbox, self.publisher_io, self.encoder, samples)
        self.reports = Reports(self.heads)
        self.started = time.monotonic()
        self.accepted = 0
        self.next_id = 1
        self.draining = False
        self.drained_sent = False
        self.bound = False
        self.restarting: str | None = None  # what failed, while no instance serves
        self.hosts_missing: list[str] = []  # a plan across hosts: hosts whose kvasird join is not there
        self.last_failure: str | None = None
        self.last_failure_at = 0.0
        self.stopped = asyncio.Event()
        self.tasks = Supervised()  # every loop of the bridge: one that dies ends the process

    # -- serving -----------------------------------------------------------------------
    async def serve(self) -> None:
        await self.control.send(self.encoder.encode(Ready("bridge", 0, os.getpid())))
        tasks = self.tasks
        for name, coro in (
            ("stages", self._stages()),
            ("commands", self._commands()),
            ("heartbeat", self._heartbeat()),
            ("outbox", self.outbox.run()),
        ):
            tasks.start(coro, name)
        if self.moves.auto is not None:
            tasks.start(self.moves.follow(self.requests, self.reports.stages), "planner")
        tasks.start(self.stopped.wait(), "stopped", may_return=True)
        try:
            await tasks.until_one_ends()  # "stopped", or a broken loop: fatal, the launcher sees us exit
        finally:
            self.outbox.end_turn()  # what this turn has for clients leaves before the sockets close
            await tasks.close()

    async def _clients(self, io: BatchedSocket, origin: str = LOCAL) -> None:
        """Read one client socket. ``origin``: its clients' tenant (LOCAL), or "curve"
        where each remote client's tenant is the key it authenticated with."""
        keyed = origin == "curve"
        while True:
            for frames in await io.recv_batch(multipart=True, copy=not keyed):
                if keyed:  # the ZAP handler's User-Id: the client's public key (z85)
                    origin, frames = f"curve:{frames[-1].get('User-Id')}", [frame.bytes for frame in frames]
                await self._client_message(io, frames, origin)
            await asyncio.sleep(0)  # a client that never pauses must not starve heartbeats, tokens, CURVE

    async def _client_message(self, io: BatchedSocket, frames: list[bytes], origin: str) -> None:
        if len(frames) != 2:
            if frames:
                error = ErrorEvent(code="invalid_request", message=f"expected one frame, got {len(frames) - 1}")
                await self._send(Peer(io, frames[0]), error)
            return
        identity, body = frames
        peer = Peer(io, identity)
        try:
            members = envelopes.members(body)
        except envelopes.BatchError as exc:
            await self._send(peer, ErrorEvent(code="invalid_request", message=str(exc)))
            return
        for member in members:
            try:
                await self._client_body(peer, member, origin)
            except Exception as exc:  # a bug met by one message: that client is told, everyone else served
                self.internal_errors += 1
                self.log.exception("a client message failed", errors=self.internal_errors)
                await self._send(peer, ErrorEvent(code="internal_error", message=f"the bridge failed on it: {exc}"))

    async def _client_body(self, peer: Peer, body: bytes, origin: str) -> None:
        try:
            message = self.client_decoder.decode(body)
        except Malformed as exc:
            key = self.submissions.key_of(body)
            await self._send(peer, ErrorEvent(code="invalid_request", message=f"malformed message: {exc}", key=key))
            return
        match message:
            case Submit():
                await self._submit(peer, message, origin)
            case Cancel(request_id=rid):
                await self._cancel(peer, rid)
            case StatsQuery(key=key, timeline=timeline):
                await self._send(peer, StatsReply(key=key, stats=daemon_stats(self, timeline)))
            case Move() | DrainHost():
                await self._send(peer, self.moves.asked(message, origin == LOCAL, self.draining, time.monotonic()))

    async def _submit(self, peer: Peer, msg: Submit, origin: str) -> None:
        try:
            if self.draining:
                raise RequestError("shutting_down", "the daemon is shutting down and takes no new requests")
            if self.restarting is not None:
                raise RequestError(
                    "restarting",
                    f"the daemon is restarting after a failure ({self.restarting}): retry in a few seconds",
                )
            if len(self.requests) >= self.max_waiting:
                raise RequestError("overloaded", f"{len(self.requests)} requests are already waiting or running")
            mine = self.requests.held_by(peer)
            if mine >= self.max_per_client:
                raise RequestError(
                    "overloaded", f"this client already has {mine} requests in the daemon (bridge.max_per_client)"
                )
            ids, sampling, root = self.submissions.read(msg, origin)
            choice, decode = self.heads.pick(ids, root, msg.session)
        except RequestError as exc:
            await self._send(peer, ErrorEvent(code=exc.code, message=exc.message, key=msg.key))
            return
        rid = self.next_id
        self.next_id += 1
        self.accepted += 1
        detok = detokenizer(self.tokenizer, msg.skip_special_tokens) if self.tokenizer is not None else None
        record = Pending(peer, msg.key, len(ids), time.monotonic_ns(), detok, sampling.logprobs >= 0)
        record.routed(choice, decode)
        self.requests.add(rid, record)
        self.metrics.accepted(len(ids))
        client = self.requests.number(peer)
        await self._send(peer, Accepted(key=msg.key, request_id=rid))
        head = self.heads.head_of[decode] if decode is not None else -1
        enqueue = Enqueue(rid, tuple(ids), sampling, client, root, head, choice.pooled, choice.peers)
        self.outbox.after_turn(partial(self._enqueue, rid, self.encoder.encode(enqueue)))

    def _enqueue(self, rid: int, body: bytes) -> None:
        """Hand a request to the head once its Accepted has left: one whose client could
        not be told (gone, or not reading) is never enqueued, nothing runs for nobody."""
        record = self.requests.get(rid)
        if record is not None:
            record.enqueued_ns = time.monotonic_ns()
            self.heads.send_now(record.instance, body)

    async def _cancel(self, peer: Peer, rid: int) -> None:
        record = self.requests.get(rid)
        if record is None or record.peer != peer:
            await self._send(
                peer, ErrorEvent(code="unknown_request", message=f"no running request {rid} of yours", request_id=rid)
            )
            return
        await self.heads.send(
            self.heads.cancel_to(record.instance, record.decode), self.encoder.encode(CancelRequest(rid))
        )

    async def _stages(self) -> None:
        while True:
            for body in await self.inbox_io.recv_batch():
                try:
                    message = self.inbox_decoder.decode(body)
                except Malformed as exc:
                    self._malformed("bridge-in", exc)
                    continue
                await self._stage_message(message)
            for name in self.moves.due(self.requests):
                await self.heads.send(name, self.encoder.encode(Retire(self.heads.head_of[name])))
            await self._maybe_drained()
            await asyncio.sleep(0)

    def _malformed(self, socket: str, exc: Exception) -> None:
        """An internal message that does not decode: a bug, a version mix or a stray
        process of the daemon's user. Dropped and logged; the bridge keeps serving."""
        self.malformed += 1
        self.log.warning("dropped a malformed internal message", socket=socket, error=str(exc), dropped=self.malformed)

    async def _stage_message(self, message: BridgeMessage) -> None:
        match message:
            case TokenEvents(tokens=tokens, prompt=prompt):
                for scores in prompt:
                    self.streams.prompt_scores(scores)
                for token in tokens:
                    await self.streams.token(token)
            case RequestEnded(request_id=rid, code=code, message=text):
                record = self.requests.end(rid)
                if record is not None:
                    self.metrics.ended_early(code)
                    event = (
                        Cancelled(request_id=rid)
                        if code == "cancelled"
                        else ErrorEvent(code=code, message=text, request_id=rid)
                    )
                    await self._send(record.peer, event)
            case HandoffReport(request_id=rid, nbytes=nbytes, seconds=seconds, copy_s=copy_s):
                timings = self.handoffs.add(nbytes, seconds, copy_s)
                record = self.requests.get(rid)
                if record is not None:
                    record.handoff = timings
            case PrefixEvents() | PoolEvents() | StageStats() | ShardStats():
                self.reports.note(message)
            case Retired(index=index, pid=pid):
                regroup = self.moves.retired(index, pid)
                if regroup is not None:  # its processes regroup in the new pool; "serve" ends the move
                    self.log.info("instance retired: regrouping it", instance=regroup[0], to=regroup[1])
                    await self.control.send(self.encoder.encode(Regroup(*regroup)))

    async def _commands(self) -> None:
        decoder: Decoder[Command] = Decoder(Command)
        while True:
            try:
                command = decoder.decode(await self.commands.recv())
            except Malformed as exc:
                self._malformed("command-bridge", exc)
                continue
            if command.kind == "serve":
                self._serve(command)
            elif command.kind == "ring_down":
                await self._ring_down(command.instance, command.message)
            elif command.kind == "parked":  # nothing of it is routed or reported until "serve"
                self.heads.park(command.instance)
                self.moves.parked(command.instance, time.monotonic())
                self.reports.forget([command.instance])
            elif command.kind == "hosts":
                self.hosts_missing = list(command.hosts)
                if self.heads.pool is not None:  # a lost host's KV pool tiers are gone with it
                    self.heads.pool.forget_hosts(command.hosts)
            elif command.kind == "drain":
                self.draining = True
                self.log.info("draining", requests=len(self.requests))
                await self._maybe_drained()
            elif command.kind == "stop":
                reason = "a stage failed" if command.code == "stage_failed" else "the daemon stopped"
                await self._end_all(command.code, f"{reason} before the request finished")
                self.clients.setsockopt(zmq.LINGER, 2000)  # let those last events reach their clients
                self.stopped.set()

    def _serve(self, command: Command) -> None:
        """Every stage is ready: bind the client endpoints (first time), take requests."""
        if not self.bound:
            self.publisher.bind(self.ends.events)
            self.clients.bind(self.ends.client)
            self.tasks.start(self._clients(self.client_io), "clients")
            if self.remote_io is not None:
                try:
                    self.remote_io.socket.bind(self.tcp)
                except zmq.ZMQError as exc:
                    raise RuntimeError(f"cannot bind bridge.tcp = {self.tcp}: {exc}") from None
                origin = "curve" if self.remote_curve else "tcp"  # no keys: loopback, every local user alike
                self.tasks.start(self._clients(self.remote_io, origin), "remote-clients")
                self.log.info("accepting remote clients", endpoint=self.tcp, curve=self.remote_curve)
            self.bound = True
        if command.message and command.message != self.last_failure:  # a bridge started after a failure
            self.last_failure, self.last_failure_at = command.message, time.monotonic()
        self.heads.serve(command.instance, command.pids, command.restarts, command.pool)
        self.restarting = None
        moved_s = self.moves.served(command.instance, time.monotonic())
        self.log.info("accepting clients", instance=command.instance, restarts=command.restarts, moved_s=moved_s)

    async def _ring_down(self, instance: str, reason: str) -> None:
        """An instance failed and is being restarted (""; every instance): end its requests
        now, route nothing to it until "serve", drop whatever was queued for its dead head
        and its stages' stale figures."""
        names = self.heads.names(instance)
        self.last_failure, self.last_failure_at = reason, time.monotonic()
        for name in names:
            self.heads.down(name, reason)
        self.moves.dropped(names)
        if not self.heads.serving:
            self.restarting = reason
        lost = [rid for rid, record in self.requests.items() if {record.instance, record.decode} & set(names)]
        self.log.warning("instance down", instances=names, reason=reason, requests=len(lost))
        message = f"{reason}; the request was lost and instance {', '.join(names)} is restarting"
        for rid in lost:
            record = self.requests.end(rid)
            if record is not None:
                self.metrics.ended_early("stage_failed")
                await self._send(record.peer, ErrorEvent(code="stage_failed", message=message, request_id=rid))
        self.reports.forget(names)

    async def _heartbeat(self) -> None:
        beat = self.encoder.encode(Heartbeat("bridge", 0, os.getpid()))
        while True:
            await self.control.send(beat)
            await asyncio.sleep(self.stats_interval_s)

    async def _maybe_drained(self) -> None:
        if self.draining and not self.requests and not self.drained_sent:
            self.drained_sent = True
            await self.control.send(self.encoder.encode(Drained()))

    async def _end_all(self, code: str, message: str) -> None:
        for rid, record in self.requests.end_all():
            self.metrics.ended_early(code)
            await self._send(record.peer, ErrorEvent(code=code, message=message, request_id=rid))

    async def _send(self, peer: Peer, event) -> None:
        """Queue one event for a client; a client that is gone, or has not read its last
        ``bridge.max_client_queue`` events or ``bridge.max_client_bytes`` bytes, loses its
        requests instead (see kvasir/bridge/outbox.py)."""
        self.outbox.deliver(peer, self.encoder.encode(event))

    def _lost(self, peer: Peer, why: str) -> None:
        """Cancel every request of a client that cannot be told anything any more."""
        self.clients_lost += 1
        rids = self.requests.of(peer)
        for rid in rids:
            record = self.requests.end(rid)
            self.metrics.ended_early("cancelled")
            if record is not None:
                target = self.heads.cancel_to(record.instance, record.decode)
                self.heads.send_now(target, self.encoder.encode(CancelRequest(rid)))
        if rids:
            self.log.warning("client lost: its requests are cancelled", why=why, requests=len(rids))
