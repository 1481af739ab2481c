"""INFO lines for destinations another process's signal woke, rate-limited.

Main's ``get_destination_retry_timings`` invalidation and ``REMOTE_SERVER_UP`` wake a
destination that was backing off or parked (``QueueManager.retry_timings_changed``,
``remote_server_up``). Each wake is one line ``destination <d> woken: <why>``, at most
``burst`` lines per ``window_s``; beyond that they are counted, and the first line of
the next window says how many were not logged (a network coming back can wake
thousands of destinations within a second).
"""

from __future__ import annotations

import logging

from federation_sender.clock import Clock
from federation_sender.telemetry.logging import log_context

log = logging.getLogger("federation_sender.queue.manager")


class WakeLog:
    def __init__(self, clock: Clock, *, burst: int = 10, window_s: float = 60.0) -> None:
        self._clock = clock
        self.burst = burst
        self.window_s = window_s
        self._window_start: float | None = None
        self._logged = 0
        self.suppressed = 0
        """Wakes not logged in the current window."""

    def woken(self, destination: str, why: str) -> None:
        now = self._clock.monotonic_s()
        earlier = ""
        if self._window_start is None or now - self._window_start >= self.window_s:
            if self.suppressed:
                earlier = f" ({self.suppressed} more destinations woken before were not logged)"
            self._window_start, self._logged, self.suppressed = now, 0, 0
        if self._logged >= self.burst:
            self.suppressed += 1
            return
        self._logged += 1
        with log_context(destination=destination):
            log.info("destination %s woken: %s%s", destination, why, earlier)
