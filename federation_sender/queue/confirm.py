"""Pacing's confirmations for one queue, the I/O half of
:mod:`~federation_sender.queue.core.pacing` (which decides what to confirm): once a room has
``confirm_after`` PDUs the receiver accepted but may not have processed yet, ask it for
the one that leaves ``confirm_after - 1`` of them until it holds it, so that its staging
queue of the room never fills up, and does not run dry while a backlog lasts.
Bounded by the policy's deadline; past it, the queue sends on unpaced for a while.
Moved out of the runner, which only runs (issue #30)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from federation_sender.aio.timing import AttemptDeadline
from federation_sender.clock import Clock
from federation_sender.queue.core.batching import Batch
from federation_sender.queue.core.pacing import PacingPolicy, RoomPacer, pages_of
from federation_sender.queue.observer import QueueObserver
from federation_sender.transport.result import EventHeld, EventProbe, SendResult

log = logging.getLogger(__name__)


class Confirmations:
    """One queue's pacing state: its rooms' unconfirmed PDUs and when a confirmation
    last failed. Made on the queue's first paced success (most queues never pace)."""

    __slots__ = ("_failed_at", "_pacer", "_request_deadline", "clock",
                 "destination", "observer", "policy")

    def __init__(self, destination: str, policy: PacingPolicy, clock: Clock,
                 observer: QueueObserver, attempt_deadline_s: float) -> None:
        self.destination = destination
        self.policy = policy
        self.clock = clock
        self.observer = observer
        self._failed_at: float | None = None
        self._pacer = RoomPacer(policy)
        self._request_deadline = AttemptDeadline(
            clock, min(policy.deadline_s, attempt_deadline_s) if policy.enabled
            else attempt_deadline_s)
        """One request's bound, or what its confirmation has left if that is less: one
        lazily armed timer for all of this queue's requests, as its transactions have
        (``AttemptDeadline``), not a timer scheduled and cancelled for each (a busy room
        asks once a transaction: 200,000 of them in ``bench/big_room.py``)."""

    def close(self) -> None:
        """The queue stopped: its request timer goes."""
        self._request_deadline.close()

    async def _ask(self, probe: EventProbe, event_id: str, left_s: float) -> EventHeld:
        """One request for ``event_id``, within ``left_s`` and the attempt deadline
        (TimeoutError past it), under the queue's one lazily armed request timer."""
        deadline = self._request_deadline
        async with asyncio.timeout(None) as timeout:
            deadline.watch(timeout, left_s)
            try:
                return await probe.event_persisted(self.destination, event_id)
            finally:
                deadline.unwatch()

    def paced(self) -> bool:
        """Pacing is on now (not within ``off_after_failure_s`` of a failure)."""
        return self.policy.paced_after(self._failed_at, self.clock.monotonic_s())

    async def held_already(self, probe: EventProbe, batch: Batch) -> frozenset[str]:
        """The PDUs of ``batch``'s catch-up pages whose newest PDU the receiver already
        holds: not sent again (``queue/core/pacing.py``, ``pages_of``); asked page by page
        until one is not held (or pacing is off after a failure)."""
        if not self.paced():
            return frozenset()
        pacing = self.policy
        held: set[str] = set()
        for tip, ids in pages_of(batch, pacing.confirm_after):
            try:
                answer = await self._ask(probe, tip, pacing.deadline_s)
            except TimeoutError:
                break
            if answer is not EventHeld.YES:
                break
            held |= ids
        return frozenset(held)

    async def after_success(self, probe: EventProbe, batch: Batch, result: SendResult,
                            stopping: Callable[[], bool],
                            on_clock: Callable[[bool], None]) -> None:
        """``batch`` was accepted: wait for the confirmations now due. ``on_clock(True)``
        while sleeping between polls (the queue is quiescent then)."""
        pacer = self._pacer
        pacer.sent(batch, result.pdu_errors)
        while (due := pacer.to_confirm()) is not None and not stopping():
            room_id, event_id = due
            if not await self._confirm(probe, event_id, stopping, on_clock):
                pacer.forget()
                return
            pacer.confirmed(room_id, event_id)

    async def _confirm(self, probe: EventProbe, event_id: str,
                       stopping: Callable[[], bool], on_clock: Callable[[bool], None]) -> bool:
        """Ask the receiver for ``event_id`` until it holds it or the deadline passes."""
        pacing = self.policy
        t0 = self.clock.monotonic_s()
        answer = EventHeld.NO_ANSWER
        for delay in pacing.poll_delays():
            left = pacing.deadline_s - (self.clock.monotonic_s() - t0)
            if left <= 0 or stopping():
                break
            try:
                answer = await self._ask(probe, event_id, left)
            except TimeoutError:
                answer = EventHeld.NO_ANSWER
            if answer is EventHeld.YES or answer is EventHeld.UNSUPPORTED:
                break
            left = pacing.deadline_s - (self.clock.monotonic_s() - t0)
            on_clock(True)  # quiescent (a stop ends it within 1 s)
            try:
                await self.clock.sleep(max(0.0, min(delay, left)))
            finally:
                on_clock(False)
        waited = self.clock.monotonic_s() - t0
        if answer is EventHeld.YES:
            self.observer.pacing_confirmed(self.destination, "confirmed", waited)
            return True
        if stopping():
            return False
        self._failed_at = self.clock.monotonic_s()
        self.observer.pacing_confirmed(self.destination, answer.value, waited)
        if answer is EventHeld.UNSUPPORTED:
            log.info("pacing %s: it does not serve GET /event; sending unpaced for %.0f s",
                     self.destination, pacing.off_after_failure_s)
            return False
        log.warning(
            "pacing %s: %s not confirmed within %.0f s (%s); sending on unpaced for "
            "%.0f s (the receiver may prune events it has not processed)",
            self.destination, event_id, waited,
            "no answer" if answer is EventHeld.NO_ANSWER else "not held yet",
            pacing.off_after_failure_s,
        )
        return False
