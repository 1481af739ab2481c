"""One destination's attempts, each within the attempt deadline (``asyncio.timeout``,
expired by :class:`~federation_sender.aio.timing.AttemptDeadline` on the injected
clock): an attempt past it is a transient failure. The runner sends through this.

A sender that bounds every attempt itself, no later than the queue's deadline and on
the same clock (the :class:`~federation_sender.transport.client.FederationClient` on
the system clock: its deadline is the federation request timeout, the queue's five
seconds longer), is not given a second one: its own always fires first, so the
queue's would only cost a timeout context per transaction. Any other sender (a test
double, a fake clock, a bound longer than the queue's) keeps the queue's deadline."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from federation_sender.aio.timing import AttemptDeadline
from federation_sender.clock import Clock, SystemClock
from federation_sender.transport.result import (
    Outcome,
    SendResult,
    Transaction,
    TransactionSender,
    attempt_bound_s,
)


class TimedAttempts:
    # Slotted: one per live queue, thousands of them in a spike.
    __slots__ = ("_clock", "_deadline", "_limit_s", "_sender", "in_flight_since")

    def __init__(self, sender: TransactionSender, clock: Clock, limit_s: float) -> None:
        self._sender = sender
        self._clock = clock
        self._limit_s = limit_s
        bound = attempt_bound_s(sender)
        self._deadline: AttemptDeadline | None = (
            None if type(clock) is SystemClock and bound is not None and bound <= limit_s
            else AttemptDeadline(clock, limit_s))
        """The queue's own deadline; None when the sender's bounds every attempt sooner
        on the same clock (the module docstring)."""
        self.in_flight_since: float | None = None
        """Monotonic start of the attempt in flight, None when there is none."""

    async def send(self, request: Transaction) -> SendResult:
        """One attempt (under the global slot its caller holds), within the deadline."""
        clock = self._clock
        t0 = clock.monotonic_s()
        self.in_flight_since = t0
        deadline = self._deadline
        try:
            if deadline is None:
                result = await self._sender.send_transaction(request)
            else:
                async with asyncio.timeout(None) as timeout:
                    deadline.watch(timeout)
                    try:
                        result = await self._sender.send_transaction(request)
                    finally:
                        deadline.unwatch()
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

    @property
    def own_deadline(self) -> bool:
        """Whether the queue bounds the attempts itself (False: the sender does)."""
        return self._deadline is not None

    def close(self) -> None:
        if self._deadline is not None:
            self._deadline.close()
