"""The registry of destination queues and everything that spans them.

* Queues are created lazily on the first item for a destination and forgotten when
  their runner exits (idle and empty, or parked in a long backoff with nothing in
  memory), so memory follows active destinations only. A parked destination's retry
  time is remembered (a dict of ints) so events for it are not even queued: they are in
  ``destination_rooms`` already and catch-up sends them when the backoff ends.
* One semaphore bounds concurrent transactions across all destinations; another bounds
  concurrent database work of queues (catch-up planning, outbox reads, persisting).
* Runners are supervised: a runner that raises is logged and forgotten; the next item or
  wake-up sweep recreates it from the database.
* The wake-up sweep runs every ``wakeup_interval_s``: it pages (keyset, by name) through
  destinations with outstanding work and no active backoff and wakes them at
  ``wakeup_rate_per_s``, jittered.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
from collections.abc import Awaitable, Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from federation_sender.clock import Clock, time_ms
from federation_sender.config import QueueSettings
from federation_sender.model import FEDERATION_STREAM
from federation_sender.queue.backoff import RESET, BackoffPolicy
from federation_sender.queue.batching import Limits
from federation_sender.queue.catchup import PduCache
from federation_sender.queue.core import DestinationCore
from federation_sender.queue.destination import DestinationState
from federation_sender.queue.intake import EventIntake
from federation_sender.queue.items import JsonDict, PduItem
from federation_sender.queue.observer import NoopObserver, QueueObserver
from federation_sender.queue.runner import DestinationRunner, RunnerConfig
from federation_sender.queue.slots import Slots
from federation_sender.queue.status import DestinationStatus
from federation_sender.queue.steps import Effects
from federation_sender.queue.store import QueueStore
from federation_sender.queue.timing import wait_or_timeout
from federation_sender.storage.protocols import Backend
from federation_sender.transport.result import TransactionSender

log = logging.getLogger(__name__)

WAKEUP_PAGE = 1000


class LeaseGuard(Protocol):
    """Fenced per-destination leases (see :mod:`federation_sender.sharding`)."""

    async def acquire_lease(self, destination: str) -> int | None: ...

    def holds_lease(self, destination: str, fencing_token: int | None = None) -> bool: ...

    def owns(self, destination: str) -> bool: ...

    async def release(self, destination: str) -> None: ...


@dataclass(frozen=True, slots=True)
class FederationEdu:
    """One row of the replication ``federation`` stream, decoded."""

    destination: str
    edu_type: str
    content: JsonDict
    key: Hashable | None = None


def _base36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        n, r = divmod(n, 36)
        out = digits[r] + out
        if n == 0:
            return out


class QueueManager:
    def __init__(
        self,
        storage: Backend,
        sender: TransactionSender,
        settings: QueueSettings,
        server_name: str,
        instance_name: str,
        clock: Clock,
        rng: random.Random,
        shard_filter: Callable[[str], bool],
        observer: QueueObserver | None = None,
        *,
        attempt_deadline_s: float = 120.0,
        poll_interval_s: float | None = None,
        db_concurrency: int = 16,
        leases: LeaseGuard | None = None,
    ) -> None:
        self.storage = storage
        self.sender = sender
        self.settings = settings
        self.server_name = server_name
        self.instance_name = instance_name
        self.clock = clock
        self.rng = rng
        self.shard_filter = shard_filter
        self.leases = leases
        self.observer: QueueObserver = observer or NoopObserver()
        self.store = QueueStore(storage)
        self.policy = BackoffPolicy.from_settings(settings)
        self.limits = Limits.from_settings(settings)
        self.runner_config = RunnerConfig(
            server_name=server_name,
            instance_name=instance_name,
            attempt_deadline_s=attempt_deadline_s,
            idle_ttl_s=settings.idle_queue_ttl_s,
            catchup_rooms_per_batch=settings.catchup_rooms_per_batch,
            catchup_max_gap_events=settings.catchup_max_gap_events,
            outbox_read_limit=settings.max_edus_per_txn,
        )
        self.txn_slots = Slots(settings.max_concurrent_transactions)
        self.db_slots = Slots(db_concurrency)
        self._runners: dict[str, DestinationRunner] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._parked: dict[str, tuple[int, int]] = {}
        """destination -> (retry_at_ms, retry_interval_ms) of queues parked in a backoff"""
        self._needs_catchup: set[str] = set()
        self._last_errors: dict[str, str] = {}
        """The last error of destinations whose queue exited before a success, so the
        next queue (and the status of a parked one) still shows it."""
        self._pdu_cache = PduCache()
        self._txn_base = _base36(time_ms(clock))
        self._txn_counter = itertools.count(1)
        self.intake = EventIntake(
            storage,
            server_name,
            instance_name,
            settings.event_batch_size,
            shard_filter,
            self._enqueue_pdus,
            self.observer,
            clock,
            poll_interval_s,
        )
        self._background: list[asyncio.Task[None]] = []
        self._federation_ack: Callable[[int], Awaitable[None]] | None = None
        self.federation_position: int | None = None
        self._started = False

    # --- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        await self.intake.load()
        self.federation_position = await self.store.load_position(
            FEDERATION_STREAM, self.instance_name
        )
        self._needs_catchup = {
            d for d in await self.store.destinations_behind() if self.shard_filter(d)
        }
        self._started = True
        self._background = [
            asyncio.create_task(self._supervise("intake", self.intake.run)),
            asyncio.create_task(self._supervise("wakeups", self._wakeup_loop)),
            asyncio.create_task(self._supervise("housekeeping", self._housekeeping_loop)),
        ]

    async def stop(self, deadline_s: float) -> None:
        """Stop intake and wake-ups, let in-flight transactions finish within
        ``deadline_s``, then cancel what is left. Positions are persisted as they
        advance, so nothing more needs saving."""
        self.intake.stop()
        for t in self._background:
            t.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        for r in self._runners.values():
            r.request_stop()
        tasks = list(self._tasks.values())
        if tasks:
            all_done = asyncio.Event()
            gathered = asyncio.gather(*tasks, return_exceptions=True)
            gathered.add_done_callback(lambda _f: all_done.set())
            await wait_or_timeout(self.clock, all_done, deadline_s)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for r in list(self._runners.values()):
            r.mark_stopped()
        self._runners.clear()
        self._tasks.clear()
        await self.store.drain()
        self._started = False

    async def _supervise(self, name: str, fn: Callable[[], Awaitable[None]]) -> None:
        while True:
            try:
                await fn()
                return
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("queue %s loop failed; restarting", name)
                await self.clock.sleep(1.0)

    # --- registry ------------------------------------------------------------------------

    def _next_txn_id(self) -> str:
        return f"{self._txn_base}.{next(self._txn_counter)}"

    def _runner(self, destination: str, create: bool = True) -> DestinationRunner | None:
        r = self._runners.get(destination)
        if r is not None and not r.finished:
            return r
        if not create or not self._started:
            return None
        self._parked.pop(destination, None)

        def on_state(old: DestinationState, new: DestinationState) -> None:
            self.observer.state_changed(destination, old, new)

        core = DestinationCore(
            destination,
            self.policy,
            self.limits,
            self.rng,
            self._next_txn_id,
            max_item_failures=self.settings.max_item_failures,
            max_rooms_per_txn=self.settings.catchup_rooms_per_batch,
            on_state_change=on_state,
            catching_up=destination in self._needs_catchup,
            parse_pdu=self._pdu_cache,
        )
        core.last_error = self._last_errors.get(destination)
        r = DestinationRunner(
            core,
            self.store,
            self.sender,
            self.txn_slots,
            self.db_slots,
            self.clock,
            self.observer,
            self.runner_config,
        )
        self._runners[destination] = r
        task = asyncio.create_task(self._run(r))
        self._tasks[destination] = task
        self.observer.queues_changed(len(self._runners))
        return r

    async def _run(self, r: DestinationRunner) -> None:
        d = r.destination
        clean = False
        leased = False
        try:
            if self.leases is not None:
                token = await self.leases.acquire_lease(d)
                if token is None:
                    # Another live instance still holds it (ownership is moving): the
                    # wake-up sweep tries again once its lease is released or lapses.
                    r.request_stop()
                    return
                leased = True
                guard = self.leases
                r.guard_sends(lambda: guard.holds_lease(d, token) and guard.owns(d))
            await r.run()
            clean = True
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("queue for %s failed; it will be recreated from the database", d)
        finally:
            if clean and not r.core.catching_up and r.core.is_empty():
                self._needs_catchup.discard(d)
            else:
                # Items may have been lost from memory: the next queue catches up.
                self._needs_catchup.add(d)
            parked = r.retry_at_ms()
            if parked is not None:
                self._parked[d] = parked
            if r.core.last_error is None:
                self._last_errors.pop(d, None)
            else:
                self._last_errors[d] = r.core.last_error
            if self._runners.get(d) is r:
                del self._runners[d]
                self._tasks.pop(d, None)
                self.observer.queues_changed(len(self._runners))
            if leased and self.leases is not None:
                try:
                    await self.leases.release(d)
                except Exception:  # the lease lapses by itself within lease_s
                    log.warning("could not release the lease on %s", d, exc_info=True)

    def _is_parked(self, destination: str) -> bool:
        parked = self._parked.get(destination)
        if parked is None:
            return False
        if time_ms(self.clock) >= parked[0]:
            del self._parked[destination]
            return False
        return True

    # --- intake --------------------------------------------------------------------------

    def notify_new_events(self, max_stream_ordering: int) -> None:
        """Poke from the events stream: events up to this position are persisted."""
        self.intake.notify(max_stream_ordering)

    def _enqueue_pdus(self, destination: str, items: Sequence[PduItem]) -> None:
        if self._is_parked(destination):
            return
        r = self._runner(destination)
        if r is not None:
            r.core.add_pdus(items)
            r.poke()

    def _runner_for_edu(self, destination: str) -> DestinationRunner | None:
        """The queue to add an ephemeral item to: none for ourselves, another shard's
        destination, or one parked in a long backoff (volatile EDUs are not kept)."""
        if destination == self.server_name or not self.shard_filter(destination):
            return None
        if self._is_parked(destination):
            return None
        return self._runner(destination)

    def enqueue_edu(
        self,
        destination: str,
        edu_type: str,
        content: JsonDict,
        key: Hashable | None = None,
    ) -> None:
        """Queue an EDU; with ``key``, a later EDU of the same type and key replaces it."""
        r = self._runner_for_edu(destination)
        if r is not None:
            r.core.add_edu(edu_type, content, key)
            r.poke()

    def enqueue_presence(self, destination: str, states: Iterable[JsonDict]) -> None:
        r = self._runner_for_edu(destination)
        if r is not None:
            r.core.add_presence(states)
            r.poke()

    def enqueue_receipt(
        self,
        destination: str,
        room_id: str,
        receipt_type: str,
        user_id: str,
        data: JsonDict,
        *,
        wake: bool = True,
    ) -> bool:
        """Queue a receipt. With ``wake=False`` it only joins a live queue, without
        starting a transaction: it rides on that queue's next one (or the caller's later
        :meth:`wake`). Returns False when it was not taken because no queue is live
        (the caller enqueues it again, waking, when it is time)."""
        if not wake:
            if destination == self.server_name or not self.shard_filter(destination):
                return True
            if self._is_parked(destination):
                return True
            live = self._runner(destination, create=False)
            if live is None:
                return False
            live.core.add_receipt(room_id, receipt_type, user_id, data)
            return True
        r = self._runner_for_edu(destination)
        if r is not None:
            r.core.add_receipt(room_id, receipt_type, user_id, data)
            r.poke()
        return True

    def wake(self, destination: str) -> bool:
        """Start a transaction for what a live queue holds; False if it holds nothing."""
        r = self._runner(destination, create=False)
        if r is None or r.core.is_empty():
            return False
        r.poke()
        return True

    def notify_outbox(self, destination: str) -> None:
        """New to-device or device-list rows for ``destination`` were persisted."""
        if not self.shard_filter(destination) or self._is_parked(destination):
            return
        r = self._runner(destination)
        if r is not None:
            r.core.poke_outbox()
            r.poke()

    def set_federation_ack(self, ack: Callable[[int], Awaitable[None]] | None) -> None:
        """``ack(token)`` sends FEDERATION_ACK; called after each processed batch."""
        self._federation_ack = ack

    async def process_federation_batch(self, token: int, edus: Sequence[FederationEdu]) -> None:
        """Queue the EDUs of a federation-stream batch, persist ``token`` as processed,
        then acknowledge it."""
        for e in edus:
            if e.edu_type == "m.presence" and e.key is None:
                push = e.content.get("push", [])
                self.enqueue_presence(e.destination, push if isinstance(push, list) else [])
            else:
                self.enqueue_edu(e.destination, e.edu_type, e.content, e.key)
        if self.federation_position is None or token > self.federation_position:
            await self.store.save_position(FEDERATION_STREAM, self.instance_name, token)
            self.federation_position = token
        if self._federation_ack is not None:
            await self._federation_ack(token)

    def rebalance(self) -> int:
        """Shard membership changed: stop the queues of destinations this instance no
        longer owns (their in-flight transaction finishes first; their leases are
        released when they stop). Returns how many were stopped."""
        n = 0
        for d, r in list(self._runners.items()):
            if not self.shard_filter(d) and r.request_stop():
                n += 1
        return n

    # --- operator and peer signals ----------------------------------------------------------

    async def remote_server_up(self, destination: str) -> None:
        """The destination talked to us: clear its backoff and send at once."""
        if not self.shard_filter(destination):
            return
        # Group-committed with other writes: a burst of servers coming back is cheap.
        await self.store.persist(destination, Effects(backoff=RESET), None, time_ms(self.clock))
        if self._parked.pop(destination, None) is not None:
            self._needs_catchup.add(destination)
        r = self._runner(destination)
        if r is not None:
            r.core.clear_backoff()
            r.poke()

    async def retry_timings_changed(self, destination: str) -> None:
        """Another process changed the destination's retry timings (Synapse's main
        invalidates ``get_destination_retry_timings`` when a remote contacts it and it
        clears the backoff): if the stored timings no longer hold it back, send at once.
        Nothing is written, so two processes cannot echo this back and forth."""
        if not self.shard_filter(destination):
            return
        row = await self.store.load_destination(destination)
        now = time_ms(self.clock)
        if row[0].active_at(now):
            return
        if self._parked.pop(destination, None) is not None:
            self._needs_catchup.add(destination)
        r = self._runner(destination, create=destination in self._needs_catchup)
        if r is not None:
            r.core.clear_backoff()
            r.poke()

    async def reset_connection(self, destination: str) -> bool:
        """Admin: clear the backoff; False if the destination was not backing off."""
        r = self._runner(destination, create=False)
        in_memory = r.core.clear_backoff() if r is not None else False
        in_db = await self.store.clear_retry(destination)
        self._parked.pop(destination, None)
        if not (in_memory or in_db):
            return False
        r = self._runner(destination)
        if r is not None:
            r.core.clear_backoff()
            r.poke()
        return True

    # --- housekeeping: deadlines and idle eviction ---------------------------------------------

    async def _housekeeping_loop(self) -> None:
        """One clock task for all queues evicts those idle past the TTL (cheaper than a
        timer per queue per wait). Attempt deadlines are each runner's own."""
        tick = min(1.0, self.runner_config.idle_ttl_s / 10)
        while True:
            await self.clock.sleep(tick)
            self.housekeeping()

    def housekeeping(self) -> None:
        now = self.clock.monotonic_s()
        ttl = self.runner_config.idle_ttl_s
        for r in list(self._runners.values()):
            r.evict_if_idle(now, ttl)

    # --- wake-ups ----------------------------------------------------------------------------

    async def _wakeup_loop(self) -> None:
        interval = self.settings.wakeup_interval_s
        await self.clock.sleep(interval * self.rng.uniform(0.0, 1.0))
        while True:
            try:
                await self.wake_due_destinations()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("wake-up sweep failed")
            await self.clock.sleep(interval * self.rng.uniform(0.9, 1.1))

    async def wake_due_destinations(self) -> int:
        """One sweep; returns how many destinations were woken."""
        rate = max(self.settings.wakeup_rate_per_s, 1.0)
        tick_s = 0.1
        per_tick = max(1, int(rate * tick_s))
        after: str | None = None
        woken = 0
        in_tick = 0
        while True:
            page = await self.store.wakeup_page(after, WAKEUP_PAGE, time_ms(self.clock))
            if not page:
                return woken
            after = page[-1]
            for d in page:
                if not self.shard_filter(d):
                    continue
                if d not in self._runners:
                    # Outstanding rows with no live queue: only catch-up can send them.
                    self._needs_catchup.add(d)
                r = self._runner(d)
                if r is None:
                    continue
                r.poke()
                woken += 1
                in_tick += 1
                if in_tick >= per_tick:
                    in_tick = 0
                    await self.clock.sleep(tick_s * self.rng.uniform(0.8, 1.2))
            if len(page) < WAKEUP_PAGE:
                return woken

    # --- status ------------------------------------------------------------------------------

    def status(self, destination: str) -> DestinationStatus | None:
        """Status of a destination with a live or parked queue; None if it has none (it is
        idle: the admin API can read ``destinations`` for the persisted state)."""
        r = self._runner(destination, create=False)
        if r is None:
            parked = self._parked.get(destination) if self._is_parked(destination) else None
            if parked is None:
                return None
            return DestinationStatus(
                destination=destination,
                state=DestinationState.BACKING_OFF,
                pending_pdus=0,
                pending_edus=0,
                in_flight_txn_id=None,
                in_flight_age_s=None,
                in_flight_attempts=0,
                last_error=self._last_errors.get(destination),
                next_retry_ts_ms=parked[0],
                retry_interval_ms=parked[1],
                catching_up=True,
                last_successful_stream_ordering=None,
            )
        return r.status(self.clock.monotonic_s())

    def statuses(self) -> list[DestinationStatus]:
        """Every live or parked queue, by name."""
        out = []
        for d in sorted({*self._runners, *self._parked}):
            s = self.status(d)
            if s is not None:
                out.append(s)
        return out

    def owed_destinations(self) -> int:
        """Destinations this instance owes something: items in memory or in flight, a
        catch-up under way or due (parked in a backoff, or behind in the database)."""
        owed = {*self._needs_catchup, *self._parked}
        for d, r in self._runners.items():
            c = r.core
            if c.pending_pdus or c.pending_edus or c.current is not None or c.catching_up:
                owed.add(d)
        return len(owed)

    def oldest_in_flight_age_s(self) -> float | None:
        starts = [
            t for r in self._runners.values() if (t := r.in_flight_since()) is not None
        ]
        if not starts:
            return None
        return self.clock.monotonic_s() - min(starts)

    def quiescent(self) -> bool:
        """Nothing is happening until a wake-up or the clock: the intake is caught up,
        no write is pending, and every queue waits (none bootstrapping, reading,
        sending or persisting). For tests and benchmarks."""
        return (
            self.intake.position >= self.intake.target
            and self.store.idle
            and all(r.quiescent for r in self._runners.values())
        )

    @property
    def active_queues(self) -> int:
        return len(self._runners)

    @property
    def events_position(self) -> int:
        return self.intake.position
