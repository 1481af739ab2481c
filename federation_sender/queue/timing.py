"""Interruptible waits on an injected :class:`Clock`."""

from __future__ import annotations

import asyncio
from typing import TypeVar

from federation_sender.clock import Clock

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

