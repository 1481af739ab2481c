"""A deterministic clock for tests: time moves only when advanced."""

from __future__ import annotations

import asyncio
import heapq
import itertools

HAND_ON_TURNS = 3
"""Loop turns :meth:`FakeClock.advance_and_settle` gives once the tasks it woke are
back: a helper task that ended (``aio/timing.py``'s ``wait_or_timeout`` timer) reaches
the task awaiting it in two (its end runs ``asyncio.wait``'s callback, which wakes that
task), and one more for what that task hands on without waiting."""

_Sleeper = tuple[float, int, "asyncio.Future[None]", "asyncio.Task[object] | None"]
"""(deadline, sequence, the future it awaits, the task that sleeps)"""

AWAY_S = 0.05
"""Real seconds :meth:`FakeClock.woken_back` waits for a woken task that neither sleeps
on the clock again nor ends: one whose work went on to wait on something else (a
socket, an event) is left to it after that."""


class FakeClock:
    """Implements :class:`federation_sender.clock.Clock`.

    ``sleep`` parks the caller until :meth:`advance` moves time past its deadline. A task
    :meth:`advance` woke counts in :attr:`woken` until it sleeps on the clock again or
    ends: a periodic tick (``supervisor.every``) counts while it reads the database, a
    timer task (``wait_or_timeout``) until it ends. :meth:`advance_and_settle` waits for
    that, not for a number of loop turns.
    """

    def __init__(self, start_s: float = 1_700_000_000.0) -> None:
        self._now = start_s
        self._mono = 0.0
        self._seq = itertools.count()
        self._sleepers: list[_Sleeper] = []
        self._woken: set[asyncio.Task[object]] = set()
        self._back: asyncio.Future[None] | None = None
        self.left_away = 0
        """Woken tasks :meth:`woken_back` stopped waiting for (for tests of the clock)."""

    def time_s(self) -> float:
        return self._now

    def monotonic_s(self) -> float:
        return self._mono

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)  # noqa: TID251 - yield to the loop only
            return
        task = asyncio.current_task()
        if task is not None:
            self._returned(task)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self._mono + seconds, next(self._seq), fut, task))
        await fut

    @property
    def pending_sleepers(self) -> int:
        return sum(1 for _, _, f, _ in self._sleepers if not f.done())

    @property
    def woken(self) -> int:
        """Tasks :meth:`advance` woke that have not slept on the clock again nor ended."""
        return len(self._woken)

    def advance(self, seconds: float) -> None:
        """Move time forward and wake every sleeper whose deadline has passed."""
        self._now += seconds
        self._mono += seconds
        while self._sleepers and self._sleepers[0][0] <= self._mono:
            _, _, fut, task = heapq.heappop(self._sleepers)
            if fut.done():
                continue
            fut.set_result(None)
            if task is not None and task not in self._woken:
                self._woken.add(task)
                task.add_done_callback(self._returned)

    def _returned(self, task: asyncio.Task[object]) -> None:
        """``task`` sleeps on the clock again, or ended."""
        if task not in self._woken:
            return
        self._woken.discard(task)
        task.remove_done_callback(self._returned)
        if not self._woken and self._back is not None:
            if not self._back.done():
                self._back.set_result(None)
            self._back = None

    async def woken_back(self, away_s: float = AWAY_S) -> None:
        """Return once every task :meth:`advance` woke sleeps on the clock again or has
        ended; after ``away_s`` real seconds, stop waiting for those that have not (their
        work waits on something else now: see :data:`AWAY_S`)."""
        if not self._woken:
            return
        if self._back is None:
            self._back = asyncio.get_running_loop().create_future()
        try:
            async with asyncio.timeout(away_s):
                await asyncio.shield(self._back)
        except TimeoutError:
            for task in list(self._woken):
                self.left_away += 1
                self._returned(task)

    async def advance_and_settle(self, seconds: float, rounds: int = HAND_ON_TURNS) -> None:
        """Advance, wait until every task it woke is back (:meth:`woken_back`), then give
        ``rounds`` loop turns to what they handed on (:data:`HAND_ON_TURNS`)."""
        self.advance(seconds)
        await self.woken_back()
        for _ in range(rounds):
            await asyncio.sleep(0)  # noqa: TID251 - a yield, not a wait
