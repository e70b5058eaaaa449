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
from kvasir.config.http import read_api_keys
from kvasir.http.api import Api
from kvasir.http.gateway import Gateway
from kvasir.http.prompts import Prompts
from kvasir.http.requests import Served
from kvasir.logs import setup_logging
from kvasir.tasks import Supervised
from kvasir.wire.control import Command, Heartbeat, Ready, WorkerSettings
from kvasir.wire.decoding import Decoder, Malformed, decode
from kvasir.wire.fabric import Sockets, open_fabric

SHUTDOWN_S = 5.0  # after "stop": how long open connections get to finish


def run_front(encoded: bytes) -> None:
    """Entry point of an HTTP front process (spawned by the launcher)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)  # the launcher owns shutdown (a group-wide signal must not kill us)
    settings = decode(encoded, WorkerSettings)
    log = setup_logging(settings.log_level, role="front", index=settings.index, pid=os.getpid())
    try:
        uvloop.run(Front(settings, log).serve())
    except Exception:
        log.exception("http front failed")
        raise SystemExit(1) from None
    log.info("http front stopped")


class Front:
    def __init__(self, settings: WorkerSettings, log) -> None:
        http, model = settings.plan.http, settings.model
        if http is None or model is None or settings.listen_fd is None or http.model_name is None:
            raise RuntimeError("the launcher sent the front no [http] plan, model facts or listening socket")
        self.settings = settings
        self.log = log
        plan = settings.plan
        tokenizer = load_tokenizer(Path(model.folder) if model.folder is not None else None)
        keys = read_api_keys(Path(http.api_keys)) if http.api_keys is not None else None
        served = Served(http.model_name, plan.model.max_seq_len, plan.bridge.max_tokens_per_request)
        self.gateway = Gateway(Path(settings.runtime_dir), log)
        self.api = Api(self.gateway, Prompts(tokenizer, plan.model.max_seq_len), served, keys, log)
        self.listener = socket.socket(fileno=settings.listen_fd)

    async def serve(self) -> None:
        settings = self.settings
        ends, fabric = open_fabric(settings.runtime_dir, settings.fabric)
        sockets = Sockets(zmq.asyncio.Context(), ends, fabric)
        name = f"front-{settings.index}"
        runner = web.AppRunner(self.api.app(), handler_cancellation=True, access_log=None, shutdown_timeout=SHUTDOWN_S)
        tasks = Supervised()
        try:
            commands = sockets.bind(zmq.PULL, ends.command(name))
            control = sockets.connect(zmq.PUSH, ends.control)
            await runner.setup()
            await web.SockSite(runner, self.listener).start()
            await control.send(msgspec.msgpack.encode(Ready("front", settings.index, os.getpid())))
            self.log.info("http front ready")
            tasks.start(self.gateway.run(), "gateway")
            tasks.start(self._heartbeat(control), "heartbeat")
            tasks.start(self._watch_launcher(), "watch-launcher", may_return=True)
            tasks.start(self._until_stop(commands), "commands", may_return=True)
            await tasks.until_one_ends()  # "stop", a gone launcher, or a broken loop (fatal)
        finally:
            await tasks.close()
            await runner.cleanup()
            await self.gateway.close()
            sockets.end()

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
