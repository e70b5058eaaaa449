"""Supervised tasks: one that dies is noticed whenever it was started."""

from __future__ import annotations

import asyncio

import pytest

from kvasir.tasks import Supervised, TaskDied

pytestmark = pytest.mark.asyncio


async def forever() -> None:
    await asyncio.Event().wait()


async def fails_soon() -> None:
    await asyncio.sleep(0.01)
    raise RecursionError("maximum recursion depth exceeded while deserializing an object")


async def test_a_task_started_after_the_wait_began_is_still_noticed():
    tasks = Supervised()
    tasks.start(forever(), "heartbeat")
    waiting = asyncio.create_task(tasks.until_one_ends())
    await asyncio.sleep(0.01)  # the wait has begun
    tasks.start(fails_soon(), "clients")
    with pytest.raises(TaskDied, match="task clients failed: RecursionError"):
        await asyncio.wait_for(waiting, 5)
    await tasks.close()


async def test_returning_is_a_stop_only_where_allowed():
    tasks = Supervised()
    tasks.start(forever(), "loop")
    tasks.start(asyncio.sleep(0), "stopped", may_return=True)
    assert await asyncio.wait_for(tasks.until_one_ends(), 5) == "stopped"
    tasks.start(asyncio.sleep(0), "reader")
    with pytest.raises(TaskDied, match="reader ended although"):
        await asyncio.wait_for(tasks.until_one_ends(), 5)
    await tasks.close()


async def test_close_cancels_everything_without_raising():
    tasks = Supervised()
    loops = [tasks.start(forever(), f"loop-{k}") for k in range(3)]
    await tasks.close()
    assert all(task.cancelled() for task in loops)
