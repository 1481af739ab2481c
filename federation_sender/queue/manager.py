"""The queue engine's public face: one object the composition root talks to.

* Queues live in a :class:`~federation_sender.queue.registry.QueueRegistry` (created
  lazily, supervised, forgotten when idle or parked in a long backoff).
* One slot limit bounds concurrent transactions across all destinations; another bounds
  concurrent database work of queues (catch-up planning, outbox reads, persisting): both
  are the :class:`~federation_sender.queue.runner_factory.RunnerFactory`'s, which builds
  every runner from what they share.
* The wake-up sweep and idle eviction are :mod:`~federation_sender.queue.housekeeping`;
  the federation stream is :mod:`~federation_sender.queue.federation_stream`; the read
  model (each queue's status, whose sums the gauges show) is
  :mod:`~federation_sender.queue.core.status`.
  Runners own their state: the manager only calls their methods.
* Its background work (the fan-out, kept running through failures: a database outage is
  one line and a restart 1 s later; the sweep and eviction ticks) runs under the
  :class:`~federation_sender.supervisor.Supervisor` :meth:`QueueManager.start` is given,
  and :meth:`QueueManager.stop` stops it there.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable, Hashable, Iterable, Sequence

from federation_sender.aio.idle import IdleSignal
from federation_sender.clock import Clock, time_ms
from federation_sender.config import QueueSettings
from federation_sender.queue.coalesce import HandOverGate
from federation_sender.queue.core.backoff import RESET
from federation_sender.queue.core.effects import Effects
from federation_sender.queue.core.items import JsonDict, PduItem
from federation_sender.queue.core.states import DestinationState
from federation_sender.queue.core.status import DestinationStatus, oldest_age_s
from federation_sender.queue.fanout import EventFanout
from federation_sender.queue.federation_stream import FederationEdu, FederationStream
from federation_sender.queue.housekeeping import Housekeeping
from federation_sender.queue.observer import NoopObserver, QueueObserver
from federation_sender.queue.persistence import QueuePersistence
from federation_sender.queue.registry import LeaseGuard, QueueRegistry
from federation_sender.queue.runner import DestinationRunner
from federation_sender.queue.runner_factory import RunnerFactory
from federation_sender.queue.wakelog import WakeLog
from federation_sender.storage.protocols import Backend, db_outage
from federation_sender.supervisor import Supervisor
from federation_sender.telemetry.metrics import QueueSnapshot
from federation_sender.transport.result import TransactionSender, signature_counts

log = logging.getLogger(__name__)

FANOUT = "queue fan-out"
"""The fan-out's task under the supervisor (its lines: "queue fan-out loop ...")."""


def _warn_deprecated(settings: QueueSettings) -> None:
    """The steady-stream hold is gone (``queue/core/loop_policy.py``): its keys still load."""
    default = QueueSettings()
    for key in ("busy_txn_interval_s", "busy_min_pdus"):
        if getattr(settings, key) != getattr(default, key):
            log.warning("queue.%s is deprecated and ignored: a destination with nothing "
                        "in flight sends at once", key)


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
        self.idle_signal = IdleSignal()
        """Raised by the fan-out, the group commit, the sweep, the registry and every
        queue whenever they may have gone idle: :meth:`quiescent` may hold now (tests and
        benchmarks wait on it instead of polling)."""
        self.store = QueuePersistence(storage, commit_gather_s=settings.commit_gather_s,
                                      idle=self.idle_signal)
        self.gate = (
            HandOverGate(clock, settings.coalesce_hold_s) if settings.coalesce_hold_s > 0 else None
        )
        self.runners = RunnerFactory(
            self.store, sender, settings, server_name, instance_name, clock, rng,
            self.observer, self.gate, attempt_deadline_s=attempt_deadline_s,
            db_concurrency=db_concurrency, idle=self.idle_signal,
        )
        # A sender that caches per destination (the federation client) is told when a
        # queue is dropped; other senders have nothing to forget.
        self.queues = QueueRegistry(self.runners, clock, self.observer, leases,
                                    getattr(sender, "forget_destination", None), self.idle_signal)
        _warn_deprecated(settings)
        self.fanout = EventFanout(
            storage, server_name, instance_name, settings.event_batch_size, shard_filter,
            self._enqueue_pdus, self.observer, clock, poll_interval_s, self.gate, self.idle_signal,
        )
        self._supervisor: Supervisor | None = None
        self._tasks: tuple[str, ...] = ()
        self.federation = FederationStream(
            self.store, instance_name, self.enqueue_edu, self.enqueue_presence
        )
        self.housekeeping = Housekeeping.from_settings(
            self.queues.live, self._wake_for_sweep, self.store.wakeup_page, clock, rng, settings,
            self.idle_signal,
        )
        self.wake_log = WakeLog(clock)
        self.catchup_at_start: list[str] = []
        """Destinations owed events recorded before the last stop, found at start (the
        worker logs how many)."""

    # --- lifecycle -----------------------------------------------------------------------

    async def start(self, supervisor: Supervisor | None = None) -> None:
        """Load the positions, then run the background work under ``supervisor`` (the
        worker's; without one, a supervisor of the manager's own: tests, benchmarks)."""
        await self.fanout.load()
        await self.federation.load()
        behind = sorted(d for d in await self.store.destinations_behind()
                        if self.shard_filter(d))
        self.queues.start(behind)
        self.catchup_at_start = behind
        self._supervisor = sup = supervisor or Supervisor(self.clock)
        sup.keep_running(FANOUT, self.fanout.run, retry_s=1.0, db_outage=db_outage, logger=log)
        self._tasks = (FANOUT, *self.housekeeping.start(sup))

    async def stop(self, deadline_s: float) -> None:
        """Stop the fan-out and wake-ups, let in-flight transactions finish within
        ``deadline_s``, then cancel what is left. Positions are persisted as they
        advance, so nothing more needs saving."""
        self.fanout.stop()
        if self._supervisor is not None:
            await self._supervisor.stop(*self._tasks)
        if self.gate is not None:
            self.gate.close()
        await self.queues.stop_all(deadline_s)
        await self.store.drain()

    # --- fan-out ----------------------------------------------------------------------------

    def notify_new_events(self, max_stream_ordering: int) -> None:
        """Poke from the events stream: events up to this position are persisted."""
        self.fanout.notify(max_stream_ordering)

    def _enqueue_pdus(self, destination: str, items: Sequence[PduItem]) -> None:
        if self.queues.is_parked(destination):
            return
        r = self.queues.get(destination)
        if r is not None:
            r.add_pdus(items)

    def _runner_for_edu(self, destination: str) -> DestinationRunner | None:
        """The queue to add an ephemeral item to: none for ourselves, another shard's
        destination, or one parked in a long backoff (volatile EDUs are not kept)."""
        if destination == self.server_name or not self.shard_filter(destination):
            return None
        if self.queues.is_parked(destination):
            return None
        return self.queues.get(destination)

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
            r.add_edu(edu_type, content, key)

    def enqueue_presence(self, destination: str, states: Iterable[JsonDict]) -> None:
        r = self._runner_for_edu(destination)
        if r is not None:
            r.add_presence(states)

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
            if self.queues.is_parked(destination):
                return True
            live = self.queues.get(destination, create=False)
            if live is None:
                return False
            live.add_receipt(room_id, receipt_type, user_id, data, wake=False)
            return True
        r = self._runner_for_edu(destination)
        if r is not None:
            r.add_receipt(room_id, receipt_type, user_id, data)
        return True

    def wake(self, destination: str) -> bool:
        """Start a transaction for what a live queue holds; False if it holds nothing."""
        r = self.queues.get(destination, create=False)
        return r is not None and r.wake_if_owed()

    def notify_outbox(self, destination: str) -> None:
        """New to-device or device-list rows for ``destination`` were persisted."""
        if not self.shard_filter(destination) or self.queues.is_parked(destination):
            return
        r = self.queues.get(destination)
        if r is not None:
            r.poke_outbox()

    def notify_all_outboxes(self) -> None:
        """Every live queue reads its outboxes again (an outbox stream's first token
        arrived: reads before it, bounded by no token, found nothing)."""
        for r in self.queues.live():
            r.poke_outbox()

    @property
    def federation_position(self) -> int | None:
        """The federation stream's persisted resume point."""
        return self.federation.position

    def set_federation_ack(self, ack: Callable[[int], Awaitable[None]] | None) -> None:
        """``ack(token)`` sends FEDERATION_ACK; called after each processed batch."""
        self.federation.set_ack(ack)

    async def process_federation_batch(self, token: int, edus: Sequence[FederationEdu]) -> None:
        """Queue the EDUs of a federation-stream batch, persist ``token`` as processed,
        then acknowledge it."""
        await self.federation.process_batch(token, edus)

    def rebalance(self) -> int:
        """Shard membership changed: stop the queues of destinations this instance no
        longer owns (their in-flight transaction finishes first; their leases are
        released when they stop). Returns how many were stopped."""
        n = 0
        for d, r in list(self.queues.runners.items()):
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
        if self.queues.resume(destination):
            self.wake_log.woken(destination, "REMOTE_SERVER_UP")

    async def retry_timings_changed(self, destination: str) -> None:
        """Another process changed the destination's retry timings (Synapse's main
        invalidates ``get_destination_retry_timings`` when a remote contacts it and it
        clears the backoff): if the stored timings no longer hold it back, send at once.
        Nothing is written, so two processes cannot echo this back and forth."""
        if not self.shard_filter(destination):
            return
        row = await self.store.load_destination(destination)
        if not row[0].active_at(time_ms(self.clock)) and self.queues.resume(
            destination, only_if_owed=True
        ):
            self.wake_log.woken(destination, "its retry timings were cleared by another "
                                "process (get_destination_retry_timings invalidated)")

    async def reset_connection(self, destination: str) -> bool:
        """Admin: clear the backoff; False if the destination was not backing off."""
        r = self.queues.get(destination, create=False)
        in_memory = r.clear_backoff(wake=False) if r is not None else False
        in_db = await self.store.clear_retry(destination)
        parked = self.queues.unpark(destination)
        if not (in_memory or in_db or parked):
            return False
        self.queues.resume(destination)
        return True

    # --- housekeeping ------------------------------------------------------------------------

    def _wake_for_sweep(self, destination: str, persisted: int | None) -> bool:
        if not self.shard_filter(destination):
            return False
        self.queues.owe_catchup(destination)
        r = self.queues.get(destination)
        if r is None:
            return False
        r.swept(persisted)
        return True

    async def wake_due_destinations(self) -> int:
        """One wake-up sweep; returns how many destinations were woken."""
        return await self.housekeeping.sweep()

    # --- status ------------------------------------------------------------------------------

    def status(self, destination: str) -> DestinationStatus | None:
        """Status of a destination with a live or parked queue; None if it has none (it is
        idle: the admin API can read ``destinations`` for the persisted state)."""
        r = self.queues.get(destination, create=False)
        if r is None:
            return self.queues.parked_status(destination)
        return r.status(self.clock.monotonic_s())

    def statuses(self) -> list[DestinationStatus]:
        """Every live or parked queue, by name."""
        out = []
        for d in sorted({*self.queues.runners, *self.queues.parked}):
            s = self.status(d)
            if s is not None:
                out.append(s)
        return out

    def snapshot(self) -> QueueSnapshot:
        """The metrics' whole-queue figures at a scrape: the statuses' sums, the owed
        destinations, the oldest attempt's age and the counters since start."""
        pdus = edus = backing = catching = short = in_flight = 0
        for st in self.statuses():
            pdus += st.pending_pdus
            edus += st.pending_edus
            backing += st.state is DestinationState.BACKING_OFF
            catching += st.catching_up
            short += st.short_retrying
            in_flight += st.in_flight_txn_id is not None
        signatures, shared = signature_counts(self.sender)
        return QueueSnapshot(
            pending_destinations=self.owed_destinations(),
            pending_pdus=pdus,
            pending_edus=edus,
            backing_off=backing,
            catching_up=catching,
            short_retrying=short,
            in_flight_transactions=in_flight,
            oldest_in_flight_age_s=self.oldest_in_flight_age_s() or 0.0,
            group_commits=self.store.commits,
            group_commit_results=self.store.committed_results,
            first_reads=self.store.gathered_reads,
            transaction_signatures=signatures,
            shared_content_signatures=shared,
        )

    def owed_destinations(self) -> int:
        """Destinations this instance owes something: items in memory or in flight, a
        catch-up under way or due (parked in a backoff, or behind in the database)."""
        return len(self.queues.owed())

    def oldest_in_flight_age_s(self) -> float | None:
        return oldest_age_s(
            (r.in_flight_since() for r in self.queues.runners.values()), self.clock.monotonic_s()
        )

    def quiescent(self) -> bool:
        """Nothing is happening until a wake-up or the clock: the fan-out is caught up,
        no write is pending, no sweep runs, and every queue waits (none bootstrapping,
        reading, sending or persisting, none woken and not yet running). For tests and
        benchmarks, which wait for it on :attr:`idle_signal`."""
        return (
            self.fanout.idle
            and self.store.idle
            and not self.housekeeping.sweeping
            and all(r.quiescent for r in self.queues.runners.values())
        )

    @property
    def active_queues(self) -> int:
        return len(self.queues.runners)

    @property
    def events_position(self) -> int:
        return self.fanout.position
