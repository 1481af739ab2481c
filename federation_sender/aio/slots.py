"""A FIFO limit on concurrent work, O(1) per acquire and release.

``asyncio.Semaphore`` (Python 3.11) keeps woken waiters in its queue until their tasks
run, and every release scans past them: with hundreds of queues waiting for a
transaction slot, each release walked hundreds of finished futures (1.5 million
``Future.done`` calls for 12,000 transactions in the fan-out benchmark). Here a release
hands its slot straight to the oldest live waiter, which leaves the queue at once.
"""

from __future__ import annotations

import asyncio
from collections import deque
from types import TracebackType


class Slots:
    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError("limit must be at least 1")
        self.limit = limit
        self._free = limit
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def in_use(self) -> int:
        return self.limit - self._free

    @property
    def waiting(self) -> int:
        return sum(1 for f in self._waiters if not f.done())

    async def acquire(self) -> None:
        if self._free > 0 and not self._waiters:
            self._free -= 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                # The slot was handed over just before the cancellation: pass it on.
                self.release()
            raise

    def release(self) -> None:
        waiters = self._waiters
        while waiters:
            fut = waiters.popleft()
            if not fut.done():  # cancelled waiters are done: skipped
                fut.set_result(None)
                return
        if self._free >= self.limit:
            raise RuntimeError("Slots released more often than acquired")
        self._free += 1

    async def hold(self) -> Held:
        """Acquire, returning a handle whose :meth:`Held.release` gives the slot back
        once, however often it is called (the runner releases it after the request and
        again, harmlessly, on every way out)."""
        await self.acquire()
        return Held(self)

    async def __aenter__(self) -> None:
        await self.acquire()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


class Held:
    """One acquired slot of :class:`Slots`; :meth:`release` is idempotent."""

    __slots__ = ("_slots",)

    def __init__(self, slots: Slots) -> None:
        self._slots: Slots | None = slots

    def release(self) -> None:
        slots, self._slots = self._slots, None
        if slots is not None:
            slots.release()
