"""A queue's wake-up signal: asyncio.Event's behaviour without its per-instance deque."""

from __future__ import annotations

import asyncio

from federation_sender.aio.timing import Wakeup, wait_or_timeout
from federation_sender.testing.clock import FakeClock
from federation_sender.testing.waiting import wait_until


async def test_set_before_wait_returns_at_once_until_cleared() -> None:
    w = Wakeup()
    w.set()
    assert w.is_set() and await w.wait()
    w.clear()
    assert not w.is_set()
    waiter = asyncio.create_task(w.wait())
    await asyncio.sleep(0)
    assert not waiter.done()
    w.set()
    assert await waiter


async def test_a_cancelled_waiter_leaves_the_other_waiting() -> None:
    w = Wakeup()
    first = asyncio.create_task(w.wait())
    second = asyncio.create_task(w.wait())
    await asyncio.sleep(0)
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    assert first.cancelled() and not second.done()
    w.set()
    assert await asyncio.wait_for(second, 5)


async def test_wait_or_timeout_on_the_injected_clock(clock: FakeClock) -> None:
    w = Wakeup()
    timed = asyncio.create_task(wait_or_timeout(clock, w, 10.0))
    await wait_until(lambda: clock.pending_sleepers, "the waiter on the clock",
                     accept=lambda n: n == 1, timeout_s=10)
    clock.advance(9.0)
    assert not timed.done()
    clock.advance(1.0)
    assert await asyncio.wait_for(timed, 5) is False
    woken = asyncio.create_task(wait_or_timeout(clock, w, 10.0))
    await wait_until(lambda: clock.pending_sleepers, "the waiter on the clock",
                     accept=lambda n: n == 1, timeout_s=10)
    w.set()
    assert await asyncio.wait_for(woken, 5) is True
