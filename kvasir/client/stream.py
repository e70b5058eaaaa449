"""One request's events as its caller reads them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from kvasir.errors import KvasirError
from kvasir.wire.client import Cancelled, ErrorEvent, Finished

TERMINAL = (Finished, Cancelled, ErrorEvent)


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
        if not isinstance(last, TERMINAL):
            raise KvasirError(f"request {self.request_id}: the stream ended without a terminal event")
        return last
