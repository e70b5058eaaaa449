"""The synchronous client: an AsyncClient on a private event-loop thread."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

from kvasir.client.async_client import AsyncClient
from kvasir.client.connection import Remote
from kvasir.client.stream import RequestStream
from kvasir.wire.client import (
    Cancelled,
    DaemonStats,
    DrainStarted,
    ErrorEvent,
    Finished,
    MoveStarted,
    MoveTarget,
)


class Client:
    """A thin synchronous wrapper: an AsyncClient on a private event-loop thread."""

    def __init__(
        self, runtime_dir: str | Path | None = None, timeout_s: float = 5.0, remote: Remote | None = None
    ) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvasir-client", daemon=True)
        self._thread.start()
        try:
            self._client = self._call(AsyncClient.connect(runtime_dir, timeout_s, remote))
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

    def move(self, instance: str, to: MoveTarget, timeout_s: float = 10.0) -> MoveStarted:
        return self._call(self._client.move(instance, to, timeout_s))

    def drain_host(self, host: str, timeout_s: float = 10.0) -> DrainStarted:
        return self._call(self._client.drain_host(host, timeout_s))

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

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
