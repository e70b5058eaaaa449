"""The front's connection to the bridge: one ``AsyncClient`` (pipelined submission, the
same as any ZeroMQ client), made once the bridge's socket is there, and the daemon's
state as the bridge last reported it (``/health``)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Literal

from kvasir.client import AsyncClient, NoDaemon
from kvasir.errors import KvasirError
from kvasir.http.errors import ApiError
from kvasir.wire.client import DaemonStats

POLL_S = 0.5  # how often the daemon's state is asked for
STALE_S = 3.0  # a state older than this is not trusted: /health says "unavailable"
RETRY_S = 0.2  # between attempts to reach a bridge that is not there yet
CONNECT_WAIT_S = 5.0  # how long a request waits for a front that is still connecting
Health = Literal["serving", "starting", "restarting", "draining", "unavailable"]


class Gateway:
    def __init__(self, runtime_dir: Path, log, connect_wait_s: float = CONNECT_WAIT_S) -> None:
        self.runtime_dir = runtime_dir
        self.log = log
        self.connect_wait_s = connect_wait_s
        self._client: AsyncClient | None = None
        self._stats: DaemonStats | None = None
        self._seen = 0.0
        self._query: asyncio.Future[DaemonStats] | None = None  # the stats query /metrics scrapes share
        self._connected = asyncio.Event()  # set while a connection stands

    async def run(self) -> None:
        """Connect (again, after the connection failed) and keep the daemon's state fresh."""
        while True:
            if self._client is None:
                try:
                    self._client = await AsyncClient.connect(self.runtime_dir, timeout_s=2.0)
                    self._connected.set()
                    self.log.info("connected to the bridge")
                except KvasirError:
                    await asyncio.sleep(RETRY_S)
                    continue
            await self._poll()
            await asyncio.sleep(POLL_S)

    async def _poll(self) -> None:
        client = self._client
        if client is None:
            return
        try:
            self._stats, self._seen = await client.stats(timeout_s=2.0), time.monotonic()
        except NoDaemon:
            self._stats = None  # no answer this time: unavailable, the connection itself stands
        except KvasirError as exc:
            self.log.warning("the connection to the bridge failed; connecting again", error=str(exc))
            self._client, self._stats = None, None
            self._connected.clear()
            await client.close()

    async def client(self) -> AsyncClient:
        """The connection; a request that arrives while the front is (re)connecting waits
        for it a little (the daemon reports serving as soon as its fronts listen)."""
        if self._client is None:
            try:
                await asyncio.wait_for(self._connected.wait(), self.connect_wait_s)
            except TimeoutError:
                pass
        if self._client is None:
            raise ApiError("starting", "the daemon is starting: retry in a few seconds")
        return self._client

    def health(self) -> Health:
        if self._client is None:
            return "starting"
        if self._stats is None or time.monotonic() - self._seen > STALE_S:
            return "unavailable"
        return self._stats.state

    async def stats(self) -> DaemonStats:
        """The daemon's statistics for /metrics, asked for now (a scraper reading counters
        from several fronts must never see one go back). Scrapes that arrive while a query
        is out share its answer: however many come, a front has one query out at a time."""
        client = await self.client()
        if self._query is None or self._query.done():
            self._query = asyncio.ensure_future(client.stats(timeout_s=5.0))
        try:
            return await asyncio.shield(self._query)
        except KvasirError as exc:
            raise ApiError("unavailable", f"the daemon did not answer: {exc}") from None

    async def close(self) -> None:
        if self._query is not None:
            self._query.cancel()
        if self._client is not None:
            await self._client.close()
            self._client = None
            self._connected.clear()
