"""``FakeClock``'s settling: a task it woke counts until it sleeps on the clock again or
ends, and ``advance_and_settle`` waits for that, not for a number of loop turns; the
queue engine's ``IdleSignal`` that ``Harness.settle`` waits on."""

from __future__ import annotations

import asyncio

from federation_sender.aio.idle import IdleSignal
from federation_sender.aio.timing import wait_or_timeout
from federation_sender.supervisor import every
from federation_sender.testing.clock import FakeClock


async def test_a_woken_tick_counts_until_it_sleeps_again() -> None:
    """A periodic tick whose work waits on I/O (here an event the test holds) is not
    back when it resumes: only its next sleep on the clock ends it."""
    clock = FakeClock()
    in_io, io_done = asyncio.Event(), asyncio.Event()
    ticks: list[float] = []

    async def tick() -> None:
        in_io.set()
        await io_done.wait()
        ticks.append(clock.monotonic_s())

    task = asyncio.create_task(every("tick", 10.0, tick, clock=clock))
    try:
        await clock.advance_and_settle(0)  # the task starts and sleeps
        assert clock.pending_sleepers == 1 and clock.woken == 0
        clock.advance(10.0)
        assert clock.woken == 1
        settled = asyncio.create_task(clock.woken_back(away_s=30))
        await in_io.wait()
        assert clock.woken == 1 and not settled.done()  # resumed, and in its I/O
        io_done.set()
        await settled
        assert ticks == [10.0] and clock.woken == 0 and clock.pending_sleepers == 1
        assert clock.left_away == 0
    finally:
        task.cancel()


async def test_advance_and_settle_runs_the_waiter_of_an_ended_timer() -> None:
    """``wait_or_timeout``'s timer is a helper task: it ends when woken, and its caller
    runs on within the hand-on turns."""
    clock = FakeClock()
    resumed = asyncio.Event()

    async def waiter() -> None:
        await wait_or_timeout(clock, asyncio.Event(), 5.0)
        resumed.set()

    task = asyncio.create_task(waiter())
    await clock.advance_and_settle(0)
    assert clock.pending_sleepers == 1
    await clock.advance_and_settle(5.0)
    assert resumed.is_set() and clock.woken == 0
    await task


async def test_a_woken_task_waiting_elsewhere_is_left_to_it() -> None:
    """Woken, a task that goes on to wait on something other than the clock is not
    waited for past ``away_s``."""
    clock = FakeClock()
    never = asyncio.Event()

    async def sleeper() -> None:
        await clock.sleep(1.0)
        await never.wait()

    task = asyncio.create_task(sleeper())
    await clock.advance_and_settle(0)
    clock.advance(1.0)
    await clock.woken_back(away_s=0.01)
    assert clock.woken == 0 and clock.left_away == 1
    task.cancel()


async def test_an_ended_task_is_back() -> None:
    clock = FakeClock()
    task = asyncio.create_task(clock.sleep(1.0))
    await clock.advance_and_settle(0)
    clock.advance(1.0)
    assert clock.woken == 1
    await clock.woken_back(away_s=30)
    assert task.done() and clock.woken == 0 and clock.left_away == 0


async def test_the_idle_signal_wakes_every_waiter_at_its_next_report() -> None:
    signal = IdleSignal()
    signal.went_idle()  # nobody waits: nothing is kept for later

    async def waiter(waiting: asyncio.Event) -> None:
        waiting.set()
        await signal.wait()  # registered before this task first suspends

    started = [asyncio.Event() for _ in range(3)]
    first, second, cancelled = (asyncio.create_task(waiter(e)) for e in started)
    for e in started:
        await e.wait()
    assert not (first.done() or second.done())
    cancelled.cancel()
    await asyncio.gather(cancelled, return_exceptions=True)
    signal.went_idle()
    async with asyncio.timeout(10):
        await asyncio.gather(first, second)
