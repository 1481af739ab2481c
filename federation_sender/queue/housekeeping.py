"""What runs across all queues on a timer: the wake-up sweep and idle eviction.

* The sweep runs every ``wakeup_interval_s`` (jittered): it pages (keyset, by name)
  through destinations with outstanding work (rows past their position or unsent outbox
  rows) and no active backoff, and wakes them at ``wakeup_rate_per_s`` in 100 ms ticks.
  A destination with no live queue gets one in catch-up mode: only catch-up can send
  rows it has not seen. A live queue whose persisted position the sweep read differs
  from its own reads it again and, lower (a repair lowered it), catches up from there.
* Eviction: one clock task for all queues asks those idle past ``idle_ttl_s`` to exit
  (cheaper than a timer per queue per wait). Attempt deadlines are each runner's own.
* Both run under the worker's :class:`~federation_sender.supervisor.Supervisor`
  (:meth:`Housekeeping.start`, as ``every`` ticks): a sweep that fails (the database
  down: one line) is skipped and the next interval tries again.
* It sees the queues through two callables (the live runners; wake one for the sweep)
  and the database through one (a page of the sweep), not the manager.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable, Iterable

from federation_sender.aio.idle import IdleSignal
from federation_sender.clock import Clock, time_ms
from federation_sender.config import QueueSettings
from federation_sender.queue.runner import DestinationRunner
from federation_sender.storage.protocols import db_outage
from federation_sender.supervisor import Supervisor

log = logging.getLogger(__name__)

WAKEUP_PAGE = 1000
TICK_S = 0.1

WakeupPage = Callable[[str | None, int, int], Awaitable[list[tuple[str, int | None]]]]
"""``(after, limit, now_ms)``: the next page, by name, of destinations with outstanding
work and no active backoff, with their persisted positions
(:meth:`~federation_sender.queue.persistence.QueuePersistence.wakeup_page`)."""
WakeForSweep = Callable[[str, int | None], bool]
"""Wake (creating, in catch-up mode, if none is live) the queue of a destination with
outstanding work, whose persisted position the sweep read as ``persisted`` (a live queue
checks it against its own); False if it is not ours or cannot run now."""

SWEEP = "wake-up sweep"
EVICTION = "idle eviction"
"""The names of the two tasks under the supervisor (and of their log lines)."""


class Housekeeping:
    def __init__(
        self,
        live: Callable[[], Iterable[DestinationRunner]],
        wake: WakeForSweep,
        wakeup_page: WakeupPage,
        clock: Clock,
        rng: random.Random,
        *,
        wakeup_interval_s: float,
        wakeup_rate_per_s: float,
        idle_ttl_s: float,
        idle: IdleSignal | None = None,
    ) -> None:
        self._live = live
        self._idle = idle or IdleSignal()
        self.sweeping = 0
        """Sweeps under way (each raises ``idle`` when it ends)."""
        self._wake = wake
        self._wakeup_page = wakeup_page
        self._clock = clock
        self._rng = rng
        self.wakeup_interval_s = wakeup_interval_s
        self.wakeup_rate_per_s = wakeup_rate_per_s
        self.idle_ttl_s = idle_ttl_s

    @classmethod
    def from_settings(
        cls, live: Callable[[], Iterable[DestinationRunner]], wake: WakeForSweep,
        wakeup_page: WakeupPage, clock: Clock, rng: random.Random, q: QueueSettings,
        idle: IdleSignal | None = None,
    ) -> Housekeeping:
        return cls(live, wake, wakeup_page, clock, rng, wakeup_interval_s=q.wakeup_interval_s,
                   wakeup_rate_per_s=q.wakeup_rate_per_s, idle_ttl_s=q.idle_queue_ttl_s,
                   idle=idle)

    def start(self, supervisor: Supervisor) -> tuple[str, ...]:
        """Run the sweep (the first one at a random point of the first interval, then
        every interval, jittered by ±10 %) and the eviction tick under ``supervisor``;
        returns the tasks' names (to stop them)."""
        interval = self.wakeup_interval_s
        supervisor.every(
            SWEEP, lambda: interval * self._rng.uniform(0.9, 1.1), self.sweep,
            first_s=lambda: interval * self._rng.uniform(0.0, 1.0),
            db_outage=db_outage, logger=log,
        )
        supervisor.every(EVICTION, min(1.0, self.idle_ttl_s / 10), self._evict, logger=log)
        return SWEEP, EVICTION

    async def sweep(self) -> int:
        """One sweep; returns how many destinations were woken."""
        self.sweeping += 1
        try:
            return await self._sweep()
        finally:
            self.sweeping -= 1
            self._idle.went_idle()

    async def _sweep(self) -> int:
        per_tick = max(1, int(max(self.wakeup_rate_per_s, 1.0) * TICK_S))
        after: str | None = None
        woken = 0
        in_tick = 0
        while True:
            page = await self._wakeup_page(after, WAKEUP_PAGE, time_ms(self._clock))
            if not page:
                return woken
            after = page[-1][0]
            for d, persisted in page:
                if not self._wake(d, persisted):
                    continue
                woken += 1
                in_tick += 1
                if in_tick >= per_tick:
                    in_tick = 0
                    await self._clock.sleep(TICK_S * self._rng.uniform(0.8, 1.2))
            if len(page) < WAKEUP_PAGE:
                return woken

    async def _evict(self) -> None:
        self.evict_idle()

    def evict_idle(self) -> int:
        """Ask every queue idle past the TTL to exit; returns how many were asked."""
        now = self._clock.monotonic_s()
        return sum(1 for r in list(self._live()) if r.evict_if_idle(now, self.idle_ttl_s))
