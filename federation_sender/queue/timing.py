"""Deadlines and interruptible waits on an injected :class:`Clock`."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

from federation_sender.clock import Clock

T = TypeVar("T")


class DeadlineExceeded(Exception):
    pass


async def with_deadline(clock: Clock, aw: Awaitable[T], timeout_s: float) -> T:
    """Await ``aw``; cancel it and raise :class:`DeadlineExceeded` after ``timeout_s``
    on ``clock``."""
    work = asyncio.ensure_future(aw)
    timer = asyncio.ensure_future(clock.sleep(timeout_s))
    try:
        await asyncio.wait({work, timer}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        work.cancel()
        timer.cancel()
        raise
    if work.done():
        timer.cancel()
        return work.result()
    # Not awaited: a sender that ignores cancellation must not wedge the queue.
    work.cancel()
    work.add_done_callback(_consume)
    raise DeadlineExceeded(f"no answer within {timeout_s:g}s")


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


def _consume(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()
