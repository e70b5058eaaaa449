"""The bridge process: its entry point, signals, logging and event loop around Bridge."""

from __future__ import annotations

import asyncio
import os
import signal

import uvloop
import zmq.asyncio

from kvasir.bridge.server import Bridge
from kvasir.logs import setup_logging
from kvasir.wire.control import BridgeSettings


def run_bridge(settings: BridgeSettings) -> None:
    """Entry point of the bridge process (spawned by the launcher)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)  # the launcher owns shutdown (a group-wide signal must not kill us)
    log = setup_logging(settings.log_level, role="bridge", pid=os.getpid())

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        bridge: Bridge | None = None
        try:
            bridge = Bridge(settings, ctx, log)
            bridge.tasks.start(_watch_launcher(settings.launcher_pid, bridge, log), "watch-launcher", may_return=True)
            log.info("bridge ready")
            await bridge.serve()
        finally:
            if bridge is not None:
                bridge.sockets.end()  # its sockets, its ZAP handler, the context
            else:
                ctx.destroy(linger=0)

    try:
        uvloop.run(main())
    except Exception:
        log.exception("bridge failed")
        raise SystemExit(1) from None
    log.info("bridge stopped")


async def _watch_launcher(launcher_pid: int, bridge: Bridge, log) -> None:
    while os.getppid() == launcher_pid:
        await asyncio.sleep(0.2)
    log.warning("launcher is gone; stopping")
    bridge.stopped.set()
