"""Pacing's confirmations for one queue, the I/O half of
:mod:`~federation_sender.queue.core.pacing` (which decides what to confirm): once a room has
``confirm_after`` PDUs the receiver accepted but may not have processed yet, ask it for
the one that leaves ``confirm_after - 1`` of them until it holds it, so that its staging
queue of the room never fills up, and does not run dry while a backlog lasts.
Bounded by the policy's deadline; past it, the queue sends on unpaced for a while.
Moved out of the runner, which only runs (issue #30).

The confirmations run beside the queue's loop, in a task of their own (issue #44): a
room waiting for its confirmation holds back only its own PDUs (the composer,
:mod:`~federation_sender.queue.core.composer`, leaves them pending), while the other
rooms' PDUs and every EDU go on. The task asks for each due room in turn, pauses
between rounds that confirmed nothing (doubling, from ``first_poll_s`` to
``max_poll_s``), and wakes the loop whenever a room is confirmed or pacing is given up.
It lives as long as the queue, idle on an event while no room is due."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from collections.abc import Set as AbstractSet

from federation_sender.aio.idle import IdleSignal
from federation_sender.aio.timing import AttemptDeadline
from federation_sender.clock import Clock
from federation_sender.queue.core.batching import Batch
from federation_sender.queue.core.pacing import PacingPolicy, RoomPacer, pages_of
from federation_sender.queue.observer import QueueObserver
from federation_sender.transport.result import EventHeld, EventProbe, SendResult

log = logging.getLogger(__name__)


class Confirmations:
    """One queue's pacing state: its rooms' unconfirmed PDUs, when a confirmation last
    failed, and the task that asks the receiver. Made on the queue's first paced success
    (most queues never pace)."""

    __slots__ = ("_check_deadline", "_due", "_failed_at", "_idle", "_pacer", "_request_deadline",
                 "_sleeping", "_task", "clock", "destination", "observer", "policy")

    def __init__(self, destination: str, policy: PacingPolicy, clock: Clock,
                 observer: QueueObserver, attempt_deadline_s: float,
                 idle: IdleSignal | None = None) -> None:
        self.destination = destination
        self._idle = idle or IdleSignal()
        """Raised when the task becomes :attr:`quiet` (it sleeps, waits for a due room
        or ends)."""
        self.policy = policy
        self.clock = clock
        self.observer = observer
        self._failed_at: float | None = None
        self._pacer = RoomPacer(policy)
        bound = min(policy.deadline_s, attempt_deadline_s) if policy.enabled \
            else attempt_deadline_s
        self._request_deadline = AttemptDeadline(clock, bound)
        """One request's bound, or what its confirmation has left if that is less: one
        lazily armed timer for all of the task's requests, as transactions have
        (``AttemptDeadline``), not a timer scheduled and cancelled for each (a busy room
        asks once a transaction: 200,000 of them in ``bench/big_room.py``)."""
        self._check_deadline = AttemptDeadline(clock, bound)
        """The same for the loop's own requests (:meth:`held_already`)."""
        self._due = asyncio.Event()
        """Set when a success may have made a room due."""
        self._task: asyncio.Task[None] | None = None
        self._sleeping = False

    @property
    def held(self) -> AbstractSet[str]:
        """The rooms waiting for their confirmation (a live view)."""
        return self._pacer.held

    @property
    def quiet(self) -> bool:
        """No request in flight: the task waits for a due room or the clock."""
        return self._task is None or self._task.done() or self._sleeping \
            or not self._pacer.held

    def close(self) -> None:
        """The queue stopped: its task and request timers go."""
        if self._task is not None:
            self._task.cancel()
            self._task = None
        self._request_deadline.close()
        self._check_deadline.close()

    async def _ask(self, deadline: AttemptDeadline, probe: EventProbe, event_id: str,
                   left_s: float) -> EventHeld:
        """One request for ``event_id``, within ``left_s`` and the attempt deadline
        (TimeoutError past it), under one of the queue's lazily armed request timers."""
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
                answer = await self._ask(self._check_deadline, probe, tip, pacing.deadline_s)
            except TimeoutError:
                break
            if answer is not EventHeld.YES:
                break
            held |= ids
        return frozenset(held)

    def after_success(self, probe: EventProbe, batch: Batch, result: SendResult,
                      stopping: Callable[[], bool], wake: Callable[[], None]) -> None:
        """``batch`` was accepted: its PDUs are unconfirmed; the task asks for the rooms
        now due (started on first use; ``wake`` wakes the queue's loop)."""
        pacer = self._pacer
        pacer.sent(batch, result.pdu_errors)
        if pacer.held:
            self.keep_asking(probe, stopping, wake)

    def keep_asking(self, probe: EventProbe, stopping: Callable[[], bool],
                    wake: Callable[[], None]) -> None:
        """Make sure the task asks for the due rooms (started again if it ended: after
        pacing was given up, or on an error, which is logged)."""
        task = self._task
        if task is None or task.done():
            if task is not None and not task.cancelled() and task.exception() is not None:
                log.error("pacing %s: confirmations failed", self.destination,
                          exc_info=task.exception())
            if not self._pacer.held:
                return
            self._task = asyncio.get_running_loop().create_task(
                self._run(probe, stopping, wake), name=f"confirm {self.destination}")
        self._due.set()

    async def _run(self, probe: EventProbe, stopping: Callable[[], bool],
                   wake: Callable[[], None]) -> None:
        pacer = self._pacer
        try:
            while not stopping():
                if not pacer.held:
                    self._due.clear()
                    self._idle.went_idle()
                    await self._due.wait()
                    continue
                if not await self._confirm_due(probe, stopping, wake):
                    return
        finally:
            self._idle.went_idle()

    async def _confirm_due(self, probe: EventProbe, stopping: Callable[[], bool],
                           wake: Callable[[], None]) -> bool:
        """Ask for every due room until none is due. False: pacing was given up (or the
        queue stops)."""
        pacing, pacer, clock = self.policy, self._pacer, self.clock
        since: dict[str, float] = {}
        """room -> when its current confirmation was first asked for."""
        delays: Iterator[float] = pacing.poll_delays()
        answer = EventHeld.NO_ANSWER
        while not stopping():
            due = pacer.due()
            if not due:
                return True
            confirmed = False
            soonest = pacing.deadline_s
            for room_id, event_id in due:
                now = clock.monotonic_s()
                t0 = since.setdefault(room_id, now)
                left = pacing.deadline_s - (now - t0)
                if left <= 0:
                    return self._give_up(event_id, answer, now - t0, wake)
                try:
                    answer = await self._ask(self._request_deadline, probe, event_id, left)
                except TimeoutError:
                    answer = EventHeld.NO_ANSWER
                if stopping():
                    return False
                if answer is EventHeld.YES:
                    pacer.confirmed(room_id, event_id)
                    del since[room_id]
                    confirmed = True
                    self.observer.pacing_confirmed(self.destination, "confirmed",
                                                   clock.monotonic_s() - t0)
                elif answer is EventHeld.UNSUPPORTED:
                    return self._give_up(event_id, answer, clock.monotonic_s() - t0, wake)
                else:
                    soonest = min(soonest, pacing.deadline_s - (clock.monotonic_s() - t0))
            if confirmed:
                wake()
                delays = pacing.poll_delays()
                continue
            self._sleeping = True
            self._idle.went_idle()
            try:
                await clock.sleep(max(0.0, min(next(delays), soonest)))
            finally:
                self._sleeping = False
        return False

    def _give_up(self, event_id: str, answer: EventHeld, waited: float,
                 wake: Callable[[], None]) -> bool:
        """A confirmation failed: send on unpaced for ``off_after_failure_s``."""
        pacing = self.policy
        self._pacer.forget()
        self._failed_at = self.clock.monotonic_s()
        self.observer.pacing_confirmed(self.destination, answer.value, waited)
        wake()
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
