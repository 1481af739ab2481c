"""A deterministic clock for tests: time moves only when advanced."""

from __future__ import annotations

import asyncio
import heapq
import itertools


class FakeClock:
    """Implements :class:`federation_sender.clock.Clock`.

    ``sleep`` parks the caller until :meth:`advance` moves time past its deadline.
    """

    def __init__(self, start_s: float = 1_700_000_000.0) -> None:
        self._now = start_s
        self._mono = 0.0
        self._seq = itertools.count()
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []

    def time_s(self) -> float:
        return self._now

    def monotonic_s(self) -> float:
        return self._mono

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)  # noqa: TID251 - yield to the loop only
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self._mono + seconds, next(self._seq), fut))
        await fut

    @property
    def pending_sleepers(self) -> int:
        return sum(1 for _, _, f in self._sleepers if not f.done())

    def advance(self, seconds: float) -> None:
        """Move time forward and wake every sleeper whose deadline has passed."""
        self._now += seconds
        self._mono += seconds
        while self._sleepers and self._sleepers[0][0] <= self._mono:
            _, _, fut = heapq.heappop(self._sleepers)
            if not fut.done():
                fut.set_result(None)

    async def advance_and_settle(self, seconds: float, rounds: int = 20) -> None:
        """Advance, then let woken tasks run a few loop iterations."""
        self.advance(seconds)
        for _ in range(rounds):
            await asyncio.sleep(0)  # noqa: TID251
