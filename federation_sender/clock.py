"""The one place that reads time or sleeps.

Everything else takes a :class:`Clock`. Production code uses :class:`SystemClock`;
tests use :class:`federation_sender.testing.clock.FakeClock`, which advances only
when told to, so backoff, keepalive and catch-up logic is tested without sleeping.

Times are floats in seconds: ``time_s()`` is wall time (for persisted timestamps
such as ``retry_last_ts``), ``monotonic_s()`` is for measuring durations and deadlines.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol


class Clock(Protocol):
    def time_s(self) -> float:
        """Seconds since the Unix epoch (wall clock)."""

    def monotonic_s(self) -> float:
        """Seconds on a monotonic clock, for durations and deadlines."""

    async def sleep(self, seconds: float) -> None:
        """Sleep for ``seconds``; cancellable."""


def time_ms(clock: Clock) -> int:
    """Wall time in integer milliseconds, the unit persisted in the database."""
    return int(clock.time_s() * 1000)


class SystemClock:
    """The real clock."""

    def time_s(self) -> float:
        return time.time()

    def monotonic_s(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))
