"""Interruptible waits on an injected :class:`Clock`."""

from __future__ import annotations

import asyncio
from typing import Protocol, TypeVar

from federation_sender.clock import Clock, SystemClock

T = TypeVar("T")


class Waitable(Protocol):
    def is_set(self) -> bool: ...

    async def wait(self) -> bool: ...


class Wakeup:
    """``asyncio.Event``'s set/clear/is_set/wait for a queue's wake-ups, without the
    ``deque`` every Event allocates for its waiters (760 bytes, with each of thousands
    of live queues): the waiters' list exists only while somebody waits, and each
    waiter has its own future, so a cancelled one (``wait_or_timeout``'s helper task)
    leaves the others waiting."""

    __slots__ = ("_set", "_waiters")

    def __init__(self) -> None:
        self._set = False
        self._waiters: list[asyncio.Future[None]] | None = None

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        if self._set:
            return
        self._set = True
        for fut in self._waiters or ():
            if not fut.done():
                fut.set_result(None)

    def clear(self) -> None:
        self._set = False

    async def wait(self) -> bool:
        if self._set:
            return True
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiters = self._waiters
        if waiters is None:
            waiters = self._waiters = []
        waiters.append(fut)
        try:
            await fut
            return True
        finally:
            waiters.remove(fut)
            if not waiters and self._waiters is waiters:
                self._waiters = None


async def wait_or_timeout(clock: Clock, event: Waitable, timeout_s: float | None) -> bool:
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



class AttemptDeadline:
    """One queue's attempt deadline: ``asyncio.timeout`` semantics (the attempt is
    cancelled and :class:`TimeoutError` raised, the cancellation accounted for by
    asyncio), measured on the injected clock.

    Each attempt enters ``asyncio.timeout(None)`` and :meth:`watch` es it; a single
    timer per queue, armed lazily, expires the attempt in flight once its deadline has
    passed. Consecutive attempts shorter than the deadline share one timer instead of
    scheduling and cancelling one each (that was 12 µs of the engine's ~85 µs per
    transaction with a null sender)."""

    __slots__ = ("_armed", "_clock", "_expires", "_fires_at", "_handle", "_seconds", "_timeout")

    def __init__(self, clock: Clock, seconds: float) -> None:
        self._clock = clock
        self._seconds = seconds
        self._timeout: asyncio.Timeout | None = None
        self._expires = 0.0
        self._armed = False
        self._fires_at = 0.0
        self._handle: asyncio.TimerHandle | asyncio.Future[None] | None = None

    @property
    def seconds(self) -> float:
        return self._seconds

    def watch(self, timeout: asyncio.Timeout, within_s: float | None = None) -> None:
        """``timeout`` (entered with no deadline) guards the attempt starting now, for
        the deadline's ``seconds`` or ``within_s`` if that is shorter. The timer is
        moved only if it would fire after this attempt's end (a shorter bound than
        every earlier one's); otherwise it fires on time or early and re-arms."""
        now = self._clock.monotonic_s()
        seconds = self._seconds if within_s is None or within_s > self._seconds else within_s
        self._timeout = timeout
        expires = self._expires = now + seconds
        if not self._armed:
            self._arm(seconds)
        elif self._fires_at > expires:
            if self._handle is not None:
                self._handle.cancel()
            self._arm(seconds)

    def unwatch(self) -> None:
        self._timeout = None

    def close(self) -> None:
        self._timeout = None
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._armed = False

    def _arm(self, delay_s: float) -> None:
        self._armed = True
        self._fires_at = self._clock.monotonic_s() + delay_s
        if type(self._clock) is SystemClock:
            self._handle = asyncio.get_running_loop().call_later(delay_s, self._fire)
        else:
            self._handle = asyncio.ensure_future(self._sleep_then_fire(delay_s))

    async def _sleep_then_fire(self, delay_s: float) -> None:
        await self._clock.sleep(delay_s)
        self._fire()

    def _fire(self) -> None:
        self._armed = False
        self._handle = None
        timeout = self._timeout
        if timeout is None:
            return  # idle: the next attempt arms the timer again
        left = self._expires - self._clock.monotonic_s()
        if left > 0:
            self._arm(left)
        else:
            timeout.reschedule(asyncio.get_running_loop().time())
