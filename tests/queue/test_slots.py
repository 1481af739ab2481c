"""The queue engine's concurrency limit: FIFO, bounded, and safe under cancellation."""

from __future__ import annotations

import asyncio

import pytest

from federation_sender.aio.slots import Slots


async def test_limit_holds_and_waiters_go_in_order() -> None:
    slots = Slots(2)
    order: list[int] = []
    running = 0
    peak = 0
    gates = [asyncio.Event() for _ in range(6)]

    async def work(i: int) -> None:
        nonlocal running, peak
        async with slots:
            running += 1
            peak = max(peak, running)
            order.append(i)
            await gates[i].wait()
            running -= 1

    tasks = [asyncio.create_task(work(i)) for i in range(6)]
    await asyncio.sleep(0)
    assert order == [0, 1] and slots.in_use == 2 and slots.waiting == 4
    for i in (1, 0, 2, 3, 4, 5):  # finish out of order; waiters still enter in order
        gates[i].set()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2, 3, 4, 5] and peak == 2
    assert slots.in_use == 0 and slots.waiting == 0


async def test_cancelled_waiter_gives_nothing_away_and_takes_nothing() -> None:
    slots = Slots(1)
    await slots.acquire()
    waiter = asyncio.create_task(slots.acquire())
    nxt = asyncio.create_task(slots.acquire())
    await asyncio.sleep(0)
    waiter.cancel()
    await asyncio.sleep(0)
    slots.release()  # skips the cancelled waiter, hands the slot to the next
    await asyncio.wait_for(nxt, 1)
    assert waiter.cancelled() and slots.in_use == 1
    slots.release()
    assert slots.in_use == 0


async def test_slot_handed_over_then_cancelled_is_passed_on() -> None:
    slots = Slots(1)
    await slots.acquire()
    first = asyncio.create_task(slots.acquire())
    second = asyncio.create_task(slots.acquire())
    await asyncio.sleep(0)
    slots.release()  # hands the slot to ``first``, whose task has not run yet
    first.cancel()  # ... and is cancelled before it does
    with pytest.raises(asyncio.CancelledError):
        await first
    await asyncio.wait_for(second, 1)  # the slot went on to ``second``
    assert slots.in_use == 1
    slots.release()
    assert slots.in_use == 0


async def test_release_without_acquire_is_an_error() -> None:
    slots = Slots(1)
    with pytest.raises(RuntimeError):
        slots.release()
    with pytest.raises(ValueError):
        Slots(0)


async def test_a_held_slot_is_given_back_once() -> None:
    """The runner releases its slot after the request and again on every way out:
    the second release must not free a slot someone else holds."""
    slots = Slots(1)
    held = await slots.hold()
    assert slots.in_use == 1
    held.release()
    held.release()
    assert slots.in_use == 0
    other = await slots.hold()
    held.release()  # a stale handle: still nothing
    assert slots.in_use == 1
    other.release()
    assert slots.in_use == 0
