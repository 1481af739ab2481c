"""The registry of live destination queues: created lazily, supervised, forgotten.

* A queue is created on the first item for a destination and forgotten when its runner
  exits (idle and empty, or parked in a long backoff with nothing in memory), so memory
  follows active destinations only. A parked destination's retry time is remembered (a
  dict of ints) so events for it are not even queued: they are in
  ``destination_rooms`` already and catch-up sends them when the backoff ends.
* Runners are supervised here, not by the worker's supervisor: a runner is one task
  for one queue's life, not a loop to restart. One that raises is logged (as the
  supervisor's tasks are, :func:`~federation_sender.supervisor.log_failure`: a database
  outage in one line) and forgotten; the next item or wake-up sweep recreates it from
  the database, in catch-up mode (items may have been lost from memory).
  :meth:`QueueRegistry.stop_all` lets them finish within the deadline, then cancels.
* With shard leases, a runner sends only while it holds its destination's lease.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from typing import Protocol

from federation_sender.aio.idle import IdleSignal
from federation_sender.aio.timing import wait_or_timeout
from federation_sender.clock import Clock, time_ms
from federation_sender.queue.core.status import DestinationStatus, parked_status
from federation_sender.queue.fanout import refused_destination
from federation_sender.queue.observer import QueueObserver
from federation_sender.queue.runner import DestinationRunner
from federation_sender.storage.protocols import db_outage
from federation_sender.supervisor import log_failure
from federation_sender.telemetry.logging import log_context

log = logging.getLogger(__name__)


class LeaseGuard(Protocol):
    """Fenced per-destination leases (see :mod:`federation_sender.sharding`)."""

    async def acquire_lease(self, destination: str) -> int | None: ...

    def holds_lease(self, destination: str, fencing_token: int | None = None) -> bool: ...

    def owns(self, destination: str) -> bool: ...

    async def release(self, destination: str) -> None: ...


class QueueRegistry:
    def __init__(
        self,
        make_runner: Callable[[str, bool, str | None], DestinationRunner],
        clock: Clock,
        observer: QueueObserver,
        leases: LeaseGuard | None = None,
        on_gone: Callable[[str], None] | None = None,
        idle: IdleSignal | None = None,
    ) -> None:
        self._make_runner = make_runner
        self._idle = idle or IdleSignal()
        """Raised when a queue is dropped (one refused its lease never ran its loop)."""
        self._on_gone = on_gone
        """Called with a destination whose queue was dropped (the sender lets go of
        what it cached for it: an idle destination holds nothing)."""
        self._clock = clock
        self._observer = observer
        self._leases = leases
        self.runners: dict[str, DestinationRunner] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self.parked: dict[str, tuple[int, int]] = {}
        """destination -> (retry_at_ms, retry_interval_ms) of queues parked in a backoff"""
        self.needs_catchup: set[str] = set()
        self.last_errors: dict[str, str] = {}
        """The last error of destinations whose queue exited before a success, so the
        next queue (and the status of a parked one) still shows it."""
        self.started = False
        """The registry owns these fields: others read them, and change them only
        through the methods below."""

    def start(self, needs_catchup: Iterable[str]) -> None:
        """Queues may be created from now on; these destinations start in catch-up."""
        self.needs_catchup = set(needs_catchup)
        self.started = True

    def owe_catchup(self, destination: str) -> None:
        """Outstanding rows in the database: unless the destination has a live queue,
        only catch-up can send them, so its next queue starts in catch-up mode."""
        if destination not in self.runners:
            self.needs_catchup.add(destination)

    def unpark(self, destination: str) -> bool:
        """Forget a parked destination's retry time; True if it was parked."""
        return self.parked.pop(destination, None) is not None

    def live(self) -> list[DestinationRunner]:
        return list(self.runners.values())

    def parked_status(self, destination: str) -> DestinationStatus | None:
        """Status of a destination parked in a backoff (None if it is not)."""
        parked = self.parked.get(destination)
        if parked is None or not self.is_parked(destination):
            return None
        return parked_status(destination, *parked, self.last_errors.get(destination))

    def owed(self) -> set[str]:
        """Destinations owed something: items in memory or in flight, a catch-up under
        way or due (parked in a backoff, or behind in the database)."""
        owed = {*self.needs_catchup, *self.parked}
        owed.update(d for d, r in self.runners.items() if r.owes_something())
        return owed

    def get(self, destination: str, create: bool = True) -> DestinationRunner | None:
        r = self.runners.get(destination)
        if r is not None and not r.finished:
            return r
        if not create or not self.started or refused_destination(destination):
            return None
        self.parked.pop(destination, None)
        r = self._make_runner(
            destination, destination in self.needs_catchup, self.last_errors.get(destination)
        )
        self.runners[destination] = r
        self._tasks[destination] = asyncio.create_task(self._run(r))
        self._observer.queues_changed(len(self.runners))
        return r

    def resume(self, destination: str, only_if_owed: bool = False) -> bool:
        """The backoff is over (cleared): a parked destination gets a queue in catch-up
        mode, a live queue forgets its backoff and sends at once. ``only_if_owed``: no
        new queue unless the destination needs a catch-up. True if this woke the
        destination (it was parked or backing off, or got a new queue)."""
        parked = self.parked.pop(destination, None) is not None
        if parked:
            self.needs_catchup.add(destination)
        create = not only_if_owed or destination in self.needs_catchup
        live = self.get(destination, create=False)
        r = live or self.get(destination, create=create)
        if r is None:
            return parked
        held_back = r.clear_backoff()
        return parked or held_back or live is None

    def is_parked(self, destination: str) -> bool:
        parked = self.parked.get(destination)
        if parked is None:
            return False
        if time_ms(self._clock) >= parked[0]:
            del self.parked[destination]
            return False
        return True

    async def _run(self, r: DestinationRunner) -> None:
        # Every line about this queue names its destination, including the ones below
        # written after the runner's own context ended (failure, lease release).
        with log_context(destination=r.destination):
            await self._run_queue(r)

    async def _run_queue(self, r: DestinationRunner) -> None:
        d = r.destination
        clean = False
        leased = False
        try:
            if self._leases is not None:
                guard = self._leases
                token = await guard.acquire_lease(d)
                if token is None:
                    # Another live instance still holds it (ownership is moving): the
                    # wake-up sweep tries again once its lease is released or lapses.
                    r.request_stop()
                    return
                leased = True
                r.guard_sends(lambda: guard.holds_lease(d, token) and guard.owns(d))
            await r.run()
            clean = True
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the top of the queue's task: the next item recreates it
            # The database restarting or unreachable is expected, and one line.
            log_failure(log, e, f"queue for {d}", db_outage=db_outage,
                        then="; it will be recreated from the database")
        finally:
            self._forget(r, clean)
            if leased and self._leases is not None:
                try:
                    await self._leases.release(d)
                except Exception:  # the lease lapses by itself within lease_s
                    log.warning("could not release the lease on %s", d, exc_info=True)

    def _forget(self, r: DestinationRunner, clean: bool) -> None:
        d = r.destination
        if clean and r.left_clean():
            self.needs_catchup.discard(d)
        else:
            # Items may have been lost from memory: the next queue catches up.
            self.needs_catchup.add(d)
        parked = r.retry_at_ms()
        if parked is not None:
            self.parked[d] = parked
        err = r.last_error
        if err is None:
            self.last_errors.pop(d, None)
        else:
            self.last_errors[d] = err
        if self.runners.get(d) is r:
            del self.runners[d]
            self._tasks.pop(d, None)
            self._observer.queues_changed(len(self.runners))
            if self._on_gone is not None:
                self._on_gone(d)
        self._idle.went_idle()

    async def stop_all(self, deadline_s: float) -> None:
        """Let in-flight transactions finish within ``deadline_s``, then cancel."""
        for r in self.runners.values():
            r.request_stop()
        tasks = list(self._tasks.values())
        if tasks:
            all_done = asyncio.Event()
            gathered = asyncio.gather(*tasks, return_exceptions=True)
            gathered.add_done_callback(lambda _f: all_done.set())
            await wait_or_timeout(self._clock, all_done, deadline_s)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for r in list(self.runners.values()):
            r.mark_stopped()
        self.runners.clear()
        self._tasks.clear()
        self.started = False
