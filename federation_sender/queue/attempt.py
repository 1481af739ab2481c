"""One destination's attempts, each within the attempt deadline (``asyncio.timeout``,
expired by :class:`~federation_sender.queue.timing.AttemptDeadline` on the injected
clock): an attempt past it is a transient failure. The runner sends through this."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from federation_sender.clock import Clock
from federation_sender.queue.timing import AttemptDeadline
from federation_sender.transport.result import (
    Outcome,
    SendResult,
    Transaction,
    TransactionSender,
)


class TimedAttempts:
    # Slotted: one per live queue, thousands of them in a spike.
    __slots__ = ("_clock", "_deadline", "_limit_s", "_sender", "in_flight_since")

    def __init__(self, sender: TransactionSender, clock: Clock, limit_s: float) -> None:
        self._sender = sender
        self._clock = clock
        self._limit_s = limit_s
        self._deadline = AttemptDeadline(clock, limit_s)
        self.in_flight_since: float | None = None
        """Monotonic start of the attempt in flight, None when there is none."""

    async def send(self, request: Transaction) -> SendResult:
        """One attempt (under the global slot its caller holds), within the deadline."""
        clock = self._clock
        t0 = clock.monotonic_s()
        self.in_flight_since = t0
        try:
            async with asyncio.timeout(None) as timeout:
                self._deadline.watch(timeout)
                try:
                    result = await self._sender.send_transaction(request)
                finally:
                    self._deadline.unwatch()
        except TimeoutError:
            result = SendResult(
                Outcome.TRANSIENT,
                error=f"no answer within {self._limit_s:g}s",
                duration_s=clock.monotonic_s() - t0,
            )
        finally:
            self.in_flight_since = None
        if result.duration_s <= 0:
            result = replace(result, duration_s=clock.monotonic_s() - t0)
        return result

    def close(self) -> None:
        self._deadline.close()
