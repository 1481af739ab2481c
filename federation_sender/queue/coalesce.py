"""Fuller transactions when the fan-out is behind: a queue about to send a part-filled
batch of PDUs waits for the fan-out's next hand-over first.

Why: the queues send as soon as they have anything, and the fan-out reads new events in
its own database round trips on the same event loop. With hundreds of destinations in
a busy room, every hand-over of a few events wakes hundreds of queues, each sends a
transaction of those few PDUs, and the fan-out's round trips wait behind them all: the
event loop saturates on small transactions while the fan-out falls further behind
(measured against a real Synapse, 415 destinations, about 30 messages a second: 2.7
PDUs per transaction and minutes of delay, ``bench/synapse_compare.py``).

The rule: when the fan-out knows of events it has not handed over yet (its target is
past its position), a queue whose next batch would carry fewer PDUs than a transaction
holds waits for hand-overs until the batch is full, the fan-out has caught up, or
``max_hold_s`` has passed since it began to wait, then sends whatever it has: a stream
of new events never holds a queue back for longer than that. A full batch, a retry,
catch-up and EDU-only transactions never wait; nor does anything while the fan-out is
caught up (the common case on a quiet server, where this costs nothing).

A caught-up fan-out holds nothing here, and nothing else holds a queue: with nothing in
flight it sends at once, and what arrives while a transaction is in flight goes in the
next (:mod:`~federation_sender.queue.core.loop_policy`). Once the fan-out keeps up, the round
trip alone sets the transactions' size at a high rate.

Waiting for one hand-over only (the first version) was not enough against a real
Synapse: the fan-out hands over every few events, so at 415 destinations and about 30
messages a second transactions carried 9 to 11 PDUs, and the worker, CPU-bound on its
share of two cores, fell tens of seconds behind.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from federation_sender.clock import Clock

DEFAULT_MAX_HOLD_S = 0.5


class HandOverGate:
    """The fan-out's progress as the queues see it. The fan-out calls :meth:`set_behind`
    and :meth:`handed_over`; a queue calls :meth:`wait_for_hand_over`.

    Every waiting queue waits on one event per hand-over; one timer (armed by the first
    waiter) releases them all at ``max_hold_s`` if the fan-out has not handed over by
    then (a database that stalls the fan-out never stalls sending for longer)."""

    def __init__(self, clock: Clock, max_hold_s: float = DEFAULT_MAX_HOLD_S) -> None:
        self._clock = clock
        self.max_hold_s = max_hold_s
        self.behind = False
        self._handed_over = asyncio.Event()
        self._timer: asyncio.Task[None] | None = None
        self.holds = 0
        """Transactions that waited for a hand-over (for tests and benchmarks)."""

    def set_behind(self, behind: bool) -> None:
        self.behind = behind
        if not behind:
            self.handed_over()

    def handed_over(self) -> None:
        """Release every queue waiting now; the next wait is for the next hand-over."""
        ev = self._handed_over
        self._handed_over = asyncio.Event()
        ev.set()
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()

    async def wait_for_hand_over(self) -> None:
        self.holds += 1
        ev = self._handed_over
        if self._timer is None:
            self._timer = asyncio.ensure_future(self._release_after(ev))
        await ev.wait()

    async def hold(self, partial: Callable[[], bool]) -> None:
        """Wait for hand-overs while the fan-out is behind and ``partial()`` (the next
        batch would not fill a transaction), ``max_hold_s`` in all (the shared timer
        may add up to one more ``max_hold_s`` if the fan-out stalls)."""
        until = self._clock.monotonic_s() + self.max_hold_s
        while True:
            await self.wait_for_hand_over()
            if not self.behind or not partial() or self._clock.monotonic_s() >= until:
                return

    async def _release_after(self, ev: asyncio.Event) -> None:
        await self._clock.sleep(self.max_hold_s)
        if self._handed_over is ev:
            self._timer = None
            self.handed_over()

    def close(self) -> None:
        """Release any waiter and stop the timer (the manager is stopping)."""
        self.behind = False
        self.handed_over()
