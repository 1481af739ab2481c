"""Closing a session must not swallow the cancellation of the task that closes it."""

from __future__ import annotations

import asyncio

from federation_sender.replication.transport import cancel_and_wait


async def test_a_cancel_arriving_while_a_helper_winds_down_is_not_swallowed() -> None:
    helper_cancelled = asyncio.Event()
    helper_started = asyncio.Event()

    async def helper() -> None:
        helper_started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            helper_cancelled.set()
            await asyncio.Event().wait()  # slow to wind down: the caller waits here
            raise

    after_close: list[str] = []

    async def closer() -> None:
        running = asyncio.create_task(helper())
        await helper_started.wait()
        await cancel_and_wait(running)
        after_close.append("carried on")  # a swallowed cancel would get here

    task = asyncio.create_task(closer())
    await asyncio.wait_for(helper_cancelled.wait(), 5)
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=5)
    assert task in done and task.cancelled()
    assert after_close == []


async def test_the_helpers_own_cancellation_is_absorbed() -> None:
    async def helper() -> None:
        await asyncio.Event().wait()

    await cancel_and_wait(asyncio.create_task(helper()))  # returns, does not raise
