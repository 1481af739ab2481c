"""A signal that components raise whenever they may have gone idle, for whoever waits
until a whole group of them is (tests and benchmarks waiting for a quiescent queue
engine: ``testing/queue_harness.py``).

It carries no state: the waiter checks its own predicate, and only when that is false
waits for the next :meth:`IdleSignal.went_idle`, with no ``await`` between the check and
the wait, so no report is missed. A component raises it on every change from busy to
waiting (its loop waits for a wake-up or the clock, a write committed, a task ended);
a change the other way needs no report, since the waiter re-checks. Raising it with
nobody waiting costs one attribute test.
"""

from __future__ import annotations

import asyncio


class IdleSignal:
    __slots__ = ("_waiter",)

    def __init__(self) -> None:
        self._waiter: asyncio.Future[None] | None = None

    def went_idle(self) -> None:
        w = self._waiter
        if w is not None:
            self._waiter = None
            if not w.done():
                w.set_result(None)

    async def wait(self) -> None:
        """Return at the next :meth:`went_idle`."""
        if self._waiter is None or self._waiter.done():
            self._waiter = asyncio.get_running_loop().create_future()
        await asyncio.shield(self._waiter)  # one waiter's cancel leaves the others'
