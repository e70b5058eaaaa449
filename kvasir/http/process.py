"""An HTTP front process: its entry point, the launcher's socket it serves on, readiness,
heartbeats and the launcher's "stop" (asyncio on uvloop, as the bridge)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
from pathlib import Path

import msgspec
import uvloop
import zmq
import zmq.asyncio
from aiohttp import web

from kvasir.bridge.detokenizer import load_tokenizer
from kvasir.config.http import read_api_keys, shares, tls_context
from kvasir.http.api import Api
from kvasir.http.connections import ConnectionLimits, Connections
from kvasir.http.gateway import Gateway
from kvasir.http.prompts import Prompts
from kvasir.http.requests import Served
from kvasir.http.tools import tool_style
from kvasir.limits import raise_fd_limit
from kvasir.logs import setup_logging
from kvasir.tasks import Supervised
from kvasir.transport.fabric import Sockets, open_fabric
from kvasir.wire.control import Command, FrontSettings, Heartbeat, Ready
from kvasir.wire.decoding import Decoder, Malformed

SHUTDOWN_S = 5.0  # after "stop": how long open connections get to finish
BACKLOG = 1024  # connections the kernel queues for this front before it accepts them


def run_front(settings: FrontSettings) -> None:
    """Entry point of an HTTP front process (spawned by the launcher)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)  # the launcher owns shutdown (a group-wide signal must not kill us)
    raise_fd_limit()  # as the launcher did: room for http.max_connections (kvasir/limits.py)
    log = setup_logging(settings.log_level, role="front", index=settings.index, pid=os.getpid())
    try:
        uvloop.run(Front(settings, log).serve())
    except Exception:
        log.exception("http front failed")
        raise SystemExit(1) from None
    log.info("http front stopped")


class Front:
    def __init__(self, settings: FrontSettings, log) -> None:
        http, model = settings.plan.http, settings.model
        if http is None or model is None or settings.listen_fd is None or http.model_name is None:
            raise RuntimeError("the launcher sent the front no [http] plan, model facts or listening socket")
        self.settings = settings
        self.log = log
        plan = settings.plan
        tokenizer = load_tokenizer(Path(model.folder) if model.folder is not None else None, plan.model.chat_template)
        keys = read_api_keys(Path(http.api_keys)) if http.api_keys is not None else None
        choices, per_caller = shares(http, plan.bridge.max_per_client)
        served = Served.of(
            http.model_name,
            plan.model.max_seq_len,
            http.max_tokens,
            plan.bridge.max_tokens_per_request,
            max_choices=choices,
            allow_ignore_eos=http.allow_ignore_eos,
            reasoning=http.reasoning == "think",
        )
        self.gateway = Gateway(Path(settings.runtime_dir), log)
        style = tool_style(tokenizer, plan.model.tool_format)
        prompts = Prompts(tokenizer, plan.model.max_seq_len, model.vocab_size, style)
        capacity = {ring.first: ring.plan.kv.num_blocks for ring in plan.rings()}
        self.api = Api(
            self.gateway, prompts, served, keys=keys, http=http, per_caller=per_caller, log=log, kv_capacity=capacity
        )
        self.listener = socket.socket(fileno=settings.listen_fd)
        self.http = http

    async def serve(self) -> None:
        settings = self.settings
        ends, fabric = open_fabric(settings.runtime_dir, settings.fabric)
        sockets = Sockets(zmq.asyncio.Context(), ends, fabric)
        name = f"front-{settings.index}"
        runner = self._runner()
        tasks = Supervised()
        server: asyncio.Server | None = None
        try:
            commands = sockets.bind(zmq.PULL, ends.command(name))
            control = sockets.connect(zmq.PUSH, ends.control)
            await runner.setup()
            server = await self._listen(runner)
            await control.send(msgspec.msgpack.encode(Ready("front", settings.index, os.getpid())))
            self.log.info("http front ready")
            tasks.start(self.gateway.run(), "gateway")
            tasks.start(self._heartbeat(control), "heartbeat")
            tasks.start(self._watch_launcher(), "watch-launcher", may_return=True)
            tasks.start(self._until_stop(commands), "commands", may_return=True)
            await tasks.until_one_ends()  # "stop", a gone launcher, or a broken loop (fatal)
        finally:
            await tasks.close()
            if server is not None:
                server.close()  # no new connections; runner.cleanup ends the open ones
            await runner.cleanup()
            self.api.close()
            await self.gateway.close()
            sockets.end()

    def _runner(self) -> web.AppRunner:
        return web.AppRunner(
            self.api.app(),
            handler_cancellation=True,
            access_log=None,
            shutdown_timeout=SHUTDOWN_S,
            auto_decompress=False,  # compressed bodies are refused (415), never inflated
            keepalive_timeout=self.http.idle_timeout_s,
        )

    async def _listen(self, runner: web.AppRunner) -> asyncio.Server:
        """Serve on the launcher's socket, every connection through ``Connections``."""
        http = self.http
        limits = ConnectionLimits(http.max_connections, http.header_timeout_s, http.idle_timeout_s)
        server = runner.server
        if server is None:
            raise RuntimeError("the HTTP runner was not set up")
        self.api.connections = Connections(server, limits, self.log)
        loop = asyncio.get_running_loop()
        tls = None
        if http.tls_cert is not None and http.tls_key is not None:  # absolute: the plan was resolved
            tls = tls_context(http.tls_cert, http.tls_key)
        return await loop.create_server(
            self.api.connections,
            sock=self.listener,
            backlog=BACKLOG,
            ssl=tls,
            ssl_handshake_timeout=http.header_timeout_s if tls is not None else None,
        )

    async def _until_stop(self, commands) -> None:
        """Read the launcher's commands until "stop"."""
        decoder: Decoder[Command] = Decoder(Command)
        while True:
            try:
                command = decoder.decode(await commands.recv())
            except Malformed as exc:
                self.log.warning("dropped a malformed command", error=str(exc))
                continue
            if command.kind == "stop":
                return

    async def _heartbeat(self, control) -> None:
        beat = msgspec.msgpack.encode(Heartbeat("front", self.settings.index, os.getpid()))
        while True:
            await control.send(beat)
            await asyncio.sleep(self.settings.stats_interval_s)

    async def _watch_launcher(self) -> None:
        while os.getppid() == self.settings.launcher_pid:
            await asyncio.sleep(0.2)
        self.log.warning("launcher is gone; stopping")
