"""The long-lived asyncio tasks of one process, supervised: none may end unnoticed.

A process that keeps its loops in a list and waits on that list misses a task started
after the wait began: it can die and leave the process beating its heartbeat while it no
longer serves (the bridge once lost its client reader that way, and every client hung).
``Supervised`` hears each task end through a done callback, whenever it was started, so
``until_one_ends`` wakes for any of them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


class TaskDied(RuntimeError):
    """A long-lived task raised, or returned although it should run until cancelled."""


class Supervised:
    def __init__(self) -> None:
        self._tasks: dict[asyncio.Task, bool] = {}  # task -> may end by returning
        self._ended: list[asyncio.Task] = []
        self._wake = asyncio.Event()

    def start(self, coro: Coroutine[Any, Any, Any], name: str, *, may_return: bool = False) -> asyncio.Task:
        """Run ``coro`` as a task named ``name``; ``may_return``: its returning means stop."""
        task = asyncio.create_task(coro, name=name)
        self._tasks[task] = may_return
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task) -> None:
        if task in self._tasks:
            self._ended.append(task)
            self._wake.set()

    async def until_one_ends(self) -> str:
        """Wait until a task ends: its name when it was allowed to return; ``TaskDied``
        (naming it and what it raised) when it raised, was cancelled from elsewhere, or
        returned without being allowed to."""
        while not self._ended:
            self._wake.clear()
            await self._wake.wait()
        task = self._ended.pop(0)
        name = task.get_name()
        if task.cancelled():
            raise TaskDied(f"task {name} was cancelled")
        failure = task.exception()
        if failure is not None:
            raise TaskDied(f"task {name} failed: {type(failure).__name__}: {failure}") from failure
        if not self._tasks[task]:
            raise TaskDied(f"task {name} ended although it should run until stopped")
        return name

    async def close(self) -> None:
        """Cancel every task and wait for them (their own failures are not raised here)."""
        tasks = list(self._tasks)
        self._tasks.clear()  # a task ending now is being closed, not dying
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
