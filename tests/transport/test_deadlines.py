"""One timer for many attempts of the same length (transport/deadlines.py)."""

from __future__ import annotations

import asyncio

import pytest

from federation_sender.transport.deadlines import Deadlines

SECONDS = 0.05


async def attempt(deadlines: Deadlines, work: asyncio.Future[None]) -> tuple[str, float]:
    """Wait for ``work`` under the deadline; ('done' | 'timeout', loop time at the end)."""
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(None) as timeout:
            key = deadlines.watch(timeout)
            try:
                await work
            finally:
                deadlines.unwatch(key)
    except TimeoutError:
        return "timeout", loop.time()
    return "done", loop.time()


async def test_attempts_expire_at_their_own_deadline_in_start_order() -> None:
    loop = asyncio.get_running_loop()
    d = Deadlines(SECONDS)
    never: list[asyncio.Future[None]] = [loop.create_future() for _ in range(3)]
    starts: list[float] = []
    tasks = []
    for fut in never:
        starts.append(loop.time())
        tasks.append(asyncio.ensure_future(attempt(d, fut)))
        await asyncio.sleep(SECONDS / 5)  # staggered starts, so each has its own deadline
    results = await asyncio.gather(*tasks)
    assert [r[0] for r in results] == ["timeout"] * 3
    ends = [r[1] for r in results]
    assert ends == sorted(ends)
    for start, end in zip(starts, ends, strict=True):
        assert end >= start + SECONDS
    assert d.watched == 0
    d.close()


async def test_a_finished_attempt_is_never_expired_and_the_timer_moves_on() -> None:
    loop = asyncio.get_running_loop()
    d = Deadlines(SECONDS)
    quick: asyncio.Future[None] = loop.create_future()
    slow: asyncio.Future[None] = loop.create_future()
    first = asyncio.ensure_future(attempt(d, quick))
    await asyncio.sleep(0)
    second = asyncio.ensure_future(attempt(d, slow))
    await asyncio.sleep(0)
    assert d.watched == 2
    quick.set_result(None)
    assert (await first)[0] == "done"
    assert d.watched == 1
    # The timer armed for the first attempt fires with nothing due, re-arms for the
    # second, which still times out.
    assert (await second)[0] == "timeout"
    assert d.watched == 0
    d.close()


async def test_attempts_that_finish_in_time_are_untouched() -> None:
    loop = asyncio.get_running_loop()
    d = Deadlines(10.0)
    futs: list[asyncio.Future[None]] = [loop.create_future() for _ in range(50)]
    tasks = [asyncio.ensure_future(attempt(d, f)) for f in futs]
    await asyncio.sleep(0)
    for f in futs:
        f.set_result(None)
    assert [r[0] for r in await asyncio.gather(*tasks)] == ["done"] * 50
    assert d.watched == 0
    d.close()


def test_a_new_event_loop_starts_afresh() -> None:
    d = Deadlines(SECONDS)

    async def one() -> str:
        return (await attempt(d, asyncio.get_running_loop().create_future()))[0]

    assert asyncio.run(one()) == "timeout"
    assert asyncio.run(one()) == "timeout"  # the first loop's timer is gone with it
    d.close()


def test_a_deadline_must_be_positive() -> None:
    with pytest.raises(ValueError):
        Deadlines(0)
