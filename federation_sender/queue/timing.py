"""Interruptible waits on an injected :class:`Clock`."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TypeVar

from federation_sender.clock import Clock, SystemClock

T = TypeVar("T")


async def wait_or_timeout(clock: Clock, event: asyncio.Event, timeout_s: float | None) -> bool:
    """Wait for ``event`` or ``timeout_s``; True if the event was set."""
    if event.is_set():
        return True
    waiter = asyncio.ensure_future(event.wait())
    if timeout_s is None:
        await waiter
        return True
    timer = asyncio.ensure_future(clock.sleep(max(0.0, timeout_s)))
    try:
        await asyncio.wait({waiter, timer}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
        timer.cancel()
    return event.is_set()



@contextlib.asynccontextmanager
async def deadline(clock: Clock, seconds: float) -> AsyncIterator[None]:
    """``asyncio.timeout(seconds)`` measured on ``clock``: the body is cancelled and
    :class:`TimeoutError` raised when ``seconds`` pass on the injected clock (a fake
    clock in tests). The real clock uses the event loop's timer directly."""
    if type(clock) is SystemClock:
        async with asyncio.timeout(seconds):
            yield
        return
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(None) as cm:

        async def expire() -> None:
            await clock.sleep(seconds)
            cm.reschedule(loop.time())

        watcher = asyncio.ensure_future(expire())
        try:
            yield
        finally:
            watcher.cancel()
