"""What runs across all queues on a timer: the wake-up sweep and idle eviction.

* The sweep runs every ``wakeup_interval_s`` (jittered): it pages (keyset, by name)
  through destinations with outstanding work (rows past their position or unsent outbox
  rows) and no active backoff, and wakes them at ``wakeup_rate_per_s`` in 100 ms ticks.
  A destination with no live queue gets one in catch-up mode: only catch-up can send
  rows it has not seen. A live queue whose persisted position the sweep read differs
  from its own reads it again and, lower (a repair lowered it), catches up from there.
* Eviction: one clock task for all queues asks those idle past ``idle_ttl_s`` to exit
  (cheaper than a timer per queue per wait). Attempt deadlines are each runner's own.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Iterable
from typing import Protocol

from federation_sender.clock import Clock, time_ms
from federation_sender.config import QueueSettings
from federation_sender.queue.persistence import QueuePersistence
from federation_sender.queue.runner import DestinationRunner
from federation_sender.storage.protocols import db_outage

log = logging.getLogger(__name__)

WAKEUP_PAGE = 1000
TICK_S = 0.1


class Queues(Protocol):
    def live(self) -> Iterable[DestinationRunner]:
        """The queues with a runner."""
        ...

    def wake_for_sweep(self, destination: str, persisted: int | None) -> bool:
        """Wake (creating, in catch-up mode, if none is live) the queue of a destination
        with outstanding work, whose persisted position the sweep read as ``persisted``
        (a live queue checks it against its own); False if it is not ours or cannot run
        now."""
        ...


class Housekeeping:
    def __init__(
        self,
        queues: Queues,
        store: QueuePersistence,
        clock: Clock,
        rng: random.Random,
        *,
        wakeup_interval_s: float,
        wakeup_rate_per_s: float,
        idle_ttl_s: float,
    ) -> None:
        self._queues = queues
        self._store = store
        self._clock = clock
        self._rng = rng
        self.wakeup_interval_s = wakeup_interval_s
        self.wakeup_rate_per_s = wakeup_rate_per_s
        self.idle_ttl_s = idle_ttl_s

    @classmethod
    def from_settings(
        cls, queues: Queues, store: QueuePersistence, clock: Clock, rng: random.Random,
        q: QueueSettings,
    ) -> Housekeeping:
        return cls(queues, store, clock, rng, wakeup_interval_s=q.wakeup_interval_s,
                   wakeup_rate_per_s=q.wakeup_rate_per_s, idle_ttl_s=q.idle_queue_ttl_s)

    async def wakeup_loop(self) -> None:
        interval = self.wakeup_interval_s
        await self._clock.sleep(interval * self._rng.uniform(0.0, 1.0))
        while True:
            try:
                await self.sweep()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                outage = db_outage(e)
                if outage is not None:
                    log.warning("wake-up sweep skipped, the database is unavailable (%s)",
                                outage)
                else:
                    log.exception("wake-up sweep failed")
            await self._clock.sleep(interval * self._rng.uniform(0.9, 1.1))

    async def sweep(self) -> int:
        """One sweep; returns how many destinations were woken."""
        per_tick = max(1, int(max(self.wakeup_rate_per_s, 1.0) * TICK_S))
        after: str | None = None
        woken = 0
        in_tick = 0
        while True:
            page = await self._store.wakeup_page(after, WAKEUP_PAGE, time_ms(self._clock))
            if not page:
                return woken
            after = page[-1][0]
            for d, persisted in page:
                if not self._queues.wake_for_sweep(d, persisted):
                    continue
                woken += 1
                in_tick += 1
                if in_tick >= per_tick:
                    in_tick = 0
                    await self._clock.sleep(TICK_S * self._rng.uniform(0.8, 1.2))
            if len(page) < WAKEUP_PAGE:
                return woken

    async def eviction_loop(self) -> None:
        tick = min(1.0, self.idle_ttl_s / 10)
        while True:
            await self._clock.sleep(tick)
            self.evict_idle()

    def evict_idle(self) -> int:
        """Ask every queue idle past the TTL to exit; returns how many were asked."""
        now = self._clock.monotonic_s()
        return sum(1 for r in list(self._queues.live()) if r.evict_if_idle(now, self.idle_ttl_s))
