"""The asyncio shell around one :class:`DestinationCore`: reads the database, sends
transactions, sleeps, persists. It decides nothing itself.

The loop exits (and the manager forgets the queue) when the core has been empty for
``idle_ttl_s``, or when it would back off for longer than that with nothing held in
memory: everything it needs later is in the database, and the wake-up sweep recreates
it. ``wake`` cuts any wait short (new work, REMOTE_SERVER_UP, shutdown).

The runner owns its state; the manager only calls :meth:`DestinationRunner.request_stop`,
:meth:`~DestinationRunner.evict_if_idle`, :meth:`~DestinationRunner.guard_sends` and
:meth:`~DestinationRunner.status`. Each attempt has its own deadline
(``asyncio.timeout``, expired by :class:`~federation_sender.queue.timing.AttemptDeadline`
on the injected clock); an attempt past it counts as a transient failure.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType

from federation_sender.clock import Clock, time_ms
from federation_sender.config import QueueSettings
from federation_sender.queue.batching import Batch
from federation_sender.queue.coalesce import IntakeGate
from federation_sender.queue.core import DestinationCore
from federation_sender.queue.destination import DestinationState
from federation_sender.queue.observer import QueueObserver, report
from federation_sender.queue.pacing import PacingPolicy, RoomPacer
from federation_sender.queue.slots import Held, Slots
from federation_sender.queue.status import DestinationStatus, live_status
from federation_sender.queue.steps import (
    FrozenTxn,
    Idle,
    NeedCatchup,
    NeedOutbox,
    Send,
    Wait,
)
from federation_sender.queue.store import QueueStore, log_row_for
from federation_sender.queue.timing import AttemptDeadline, Wakeup, wait_or_timeout
from federation_sender.telemetry.logging import log_context
from federation_sender.transport.result import (
    EventHeld,
    EventProbe,
    Outcome,
    SendResult,
    Transaction,
    TransactionSender,
)

log = logging.getLogger(__name__)

_NO_EDUS: Mapping[str, int] = MappingProxyType({})

MAX_UNPERSISTED = 8
"""Results of one queue that may await their commit while it goes on sending."""

NO_PACING = PacingPolicy(deadline_s=0)


@dataclass(frozen=True, slots=True)
class RunnerConfig:
    server_name: str
    instance_name: str
    attempt_deadline_s: float
    idle_ttl_s: float
    catchup_rooms_per_batch: int
    catchup_max_gap_events: int
    outbox_read_limit: int
    busy_interval_s: float
    busy_min_pdus: int
    pacing: PacingPolicy = NO_PACING

    @classmethod
    def from_settings(
        cls, q: QueueSettings, server_name: str, instance_name: str, attempt_deadline_s: float
    ) -> RunnerConfig:
        return cls(
            server_name=server_name,
            instance_name=instance_name,
            attempt_deadline_s=attempt_deadline_s,
            idle_ttl_s=q.idle_queue_ttl_s,
            catchup_rooms_per_batch=q.catchup_rooms_per_batch,
            catchup_max_gap_events=q.catchup_max_gap_events,
            outbox_read_limit=q.max_edus_per_txn,
            busy_interval_s=q.busy_txn_interval_s,
            busy_min_pdus=q.busy_min_pdus,
            pacing=PacingPolicy(deadline_s=q.pacing_confirm_deadline_s),
        )


class DestinationRunner:
    # Slotted: one per live queue, thousands of them in a spike.
    __slots__ = (
        "_deadline", "_evict", "_finished", "_holding", "_idle_since",
        "_in_flight_since", "_loaded", "_may_send", "_pacer", "_pacing_failed_at", "_steady_until",
        "_stopping",
        "_unpersisted", "_waiting",
        "_window_pdus", "_window_start", "clock", "config", "core",
        "db_slots", "destination", "gate", "observer", "sender", "store", "txn_slots",
        "wake",
    )

    def __init__(
        self,
        core: DestinationCore,
        store: QueueStore,
        sender: TransactionSender,
        txn_slots: Slots,
        db_slots: Slots,
        clock: Clock,
        observer: QueueObserver,
        config: RunnerConfig,
        gate: IntakeGate | None = None,
    ) -> None:
        self.core = core
        self.gate = gate
        self.destination = core.destination
        self.store = store
        self.sender = sender
        self.txn_slots = txn_slots
        self.db_slots = db_slots
        self.clock = clock
        self.observer = observer
        self.config = config
        self.wake = Wakeup()
        self._deadline = AttemptDeadline(clock, config.attempt_deadline_s)
        self._in_flight_since: float | None = None
        self._pacing_failed_at: float | None = None
        self._pacer: RoomPacer | None = None
        """Unconfirmed PDUs per room (``queue/pacing.py``), made on the first send."""
        """When a catch-up confirmation last failed (``queue/pacing.py``)."""
        self._loaded = False
        self._stopping = False
        self._finished = False
        self._waiting = False
        """Blocked on the wake event or the clock (not reading, sending or writing)."""
        self._window_start = -math.inf
        self._window_pdus = 0
        self._steady_until = 0.0
        """Monotonic time until which the destination counts as in a steady stream,
        one interval after its last send in one (``_note_sent``); 0.0 when it is not.
        Before then a part-filled transaction waits."""
        self._holding = False
        """Waiting for ``_steady_until``: new items do not wake the queue until its
        batch is full."""
        self._unpersisted: list[asyncio.Future[None]] = []
        """Results submitted to the group commit and not yet known to be committed,
        oldest first."""
        self._idle_since: float | None = None
        """Monotonic time the queue went idle (None while busy)."""
        self._evict = False
        self._may_send: Callable[[], bool] = lambda: True
        """Checked before every attempt: False (e.g. the shard lease lapsed) stops the
        queue before it sends; the transaction stays owed in the database."""

    # --- what the manager may ask ------------------------------------------------------

    def poke(self) -> None:
        if self._holding and len(self.core.pending.pdus) < self.core.limits.max_pdus:
            return  # the hold ends by itself (a stop or an eviction sets ``wake``)
        self.wake.set()

    def request_stop(self) -> bool:
        """Stop after the attempt in flight (if any); False if already stopping."""
        if self._stopping:
            return False
        self._stopping = True
        self.wake.set()
        return True

    @property
    def finished(self) -> bool:
        return self._finished

    def guard_sends(self, may_send: Callable[[], bool]) -> None:
        """Check ``may_send()`` before every attempt (a shard lease)."""
        self._may_send = may_send

    def evict_if_idle(self, now_s: float, ttl_s: float) -> bool:
        """Ask an empty queue idle since ``ttl_s`` before ``now_s`` (monotonic) to exit."""
        since = self._idle_since
        if since is None or now_s - since < ttl_s or not self.core.is_empty():
            return False
        self._evict = True
        self.wake.set()
        return True

    def mark_stopped(self) -> None:
        if self.core.sm.state is not DestinationState.STOPPED:
            self.core.stop()

    @property
    def quiescent(self) -> bool:
        """Waiting for a wake-up or the clock, nothing in flight or unpersisted."""
        return self._finished or (
            self._waiting and not any(not f.done() for f in self._unpersisted)
        )

    def owes_something(self) -> bool:
        """Items in memory or in flight, or a catch-up under way."""
        c = self.core
        return bool(c.pending_pdus or c.pending_edus or c.current is not None or c.catching_up)

    def in_flight_since(self) -> float | None:
        """Monotonic start of the attempt in flight, None when there is none."""
        return self._in_flight_since

    def retry_at_ms(self) -> tuple[int, int] | None:
        """(retry at, interval) of a persisted backoff, for parking the destination."""
        at = self.core.backoff.retry_at_ms
        if at is None or self._stopping:
            return None
        return at, self.core.backoff.retry_interval_ms

    def status(self, now_s: float) -> DestinationStatus:
        return live_status(self.core, self._in_flight_since, now_s)

    # --- the loop ------------------------------------------------------------------------

    async def run(self) -> None:
        # The registry, which runs every runner, puts the destination in the log context.
        try:
            await self._run()
        finally:
            self._deadline.close()
            self._finished = True

    async def _run(self) -> None:
        try:
            if not self._stopping:
                await self._loop()
        finally:
            # Let the submitted results reach the database even when cancelled (the
            # group commit writes them in submission order: the newest is the last).
            pending = [f for f in self._unpersisted if not f.done()]
            if pending:
                await asyncio.shield(asyncio.gather(*pending, return_exceptions=True))
        await self._flush_persist()  # a normal exit: a failed write still surfaces

    async def _wait(self, timeout_s: float | None) -> None:
        self._waiting = True
        try:
            if timeout_s is None:
                await self.wake.wait()  # no helper task: idle waits are the common case
            else:
                await wait_or_timeout(self.clock, self.wake, timeout_s)
        finally:
            self._waiting = False

    async def _bootstrap(self) -> None:
        """Read the queue's row, outbox window and first catch-up plans (one database
        transaction) and load them into the core."""
        c = self.core
        c.outbox_read_started()
        async with self.db_slots:
            boot = await self.store.bootstrap(
                self.destination,
                self.config.server_name,
                c.catching_up,
                self.config.outbox_read_limit,
                self.config.catchup_rooms_per_batch,
                self.config.catchup_max_gap_events,
                time_ms(self.clock),
            )
        eff = c.load(boot.backoff, boot.last_successful)
        self._loaded = True
        if eff.dropped_for_catchup:
            self.observer.catchup_entered(self.destination, eff.dropped_for_catchup)
            c.poke_outbox()  # the window read was not taken
            return
        c.add_outbox(boot.to_device, boot.device_lists, boot.outbox_exhausted)
        if boot.plans and c.catching_up:
            c.offer_catchup(boot.plans, len(boot.plans) < self.config.catchup_rooms_per_batch)
        elif boot.plans == [] and c.catching_up:
            done = c.catchup_finished()
            if done.last_successful is not None:
                await self.store.persist(self.destination, done, None, time_ms(self.clock))

    async def _loop(self) -> None:
        c = self.core
        if not self._loaded:
            await self._bootstrap()
        while not self._stopping:
            self.wake.clear()
            now = time_ms(self.clock)
            gate = self.gate
            if gate is not None and gate.behind and c.would_send_partial_pdus(now):
                # A fuller transaction (coalesce.py).
                await gate.hold(lambda: c.would_send_partial_pdus(time_ms(self.clock)))
                now = time_ms(self.clock)
            if self._steady_until and c.would_send_partial_pdus(now):
                # A steady stream: at most one part-filled transaction per interval.
                await self._hold_busy()
                now = time_ms(self.clock)
            step = c.next_step(now)
            if isinstance(step, Send):
                await self._send(step.txn)
            elif isinstance(step, NeedOutbox):
                async with self.db_slots:
                    td, dl, exhausted = await self.store.read_outbox(
                        self.destination,
                        step.to_device_after,
                        step.device_lists_after,
                        self.config.outbox_read_limit,
                    )
                c.add_outbox(td, dl, exhausted)
            elif isinstance(step, NeedCatchup):
                with self.observer.catchup_step(self.destination):
                    await self._catch_up(step, now)
            elif isinstance(step, Wait):
                wait_s = max(0.0, (step.until_ms - now) / 1000.0)
                if (
                    wait_s > self.config.idle_ttl_s
                    and c.catching_up
                    and not c.pending
                    and c.current is None
                ):
                    # Nothing in memory: the wake-up sweep brings us back when due.
                    return
                await self._wait(wait_s)
            elif isinstance(step, Idle):
                if c.stopped:
                    return
                # No timer here: the manager's housekeeping evicts queues idle past the
                # TTL through ``evict_if_idle`` (one clock task for all queues).
                self._idle_since = self.clock.monotonic_s()
                await self._wait(None)
                self._idle_since = None
                if self._evict and c.is_empty():
                    return
                self._evict = False

    async def _hold_busy(self) -> None:
        """A steady stream: wait until one interval after the last send (or a full
        batch, or a request to stop), so that at a high rate each transaction carries
        more PDUs and the per-transaction work (signature, HTTP exchange, result
        write) is shared by more of them."""
        left = self._steady_until - self.clock.monotonic_s()
        if left <= 0:
            self._steady_until = 0.0
            return
        if self._stopping:
            return
        self._holding = True
        # A poke while the queue held for the intake (the hand-over it waited for) set
        # the wake-up: it must not end this hold at once. A full batch, a stop and an
        # eviction set it again.
        self.wake.clear()
        try:
            await self._wait(left)
        finally:
            self._holding = False

    def _note_sent(self, txn: FrozenTxn) -> None:
        """Count the PDUs of a new live transaction that emptied the queue's PDUs (the
        stream's supply set its size, not the limits) in the current interval (one
        starts with the first such send after the last interval ended). Once they
        reach ``busy_min_pdus`` the destination is in a steady stream, and the next
        part-filled transaction waits until one interval after this send: a batch
        that filled early does not leave its successor to go out near empty at the
        end of the interval. A transaction cut by the limits counts nothing (a
        backlog does not make a stream), but within one interval of the stream's
        last send what it left waits like the rest: a hand-over that overfilled a
        held batch does not send its remainder at once (a burst after a quiet spell
        does). Retries, catch-up and EDU-only transactions neither count nor
        wait."""
        interval = self.config.busy_interval_s
        batch = txn.batch
        if not interval or txn.attempts or batch.catchup or not batch.pdus:
            return  # an EDU-only transaction does not move the stream's clock
        now = self.clock.monotonic_s()
        if self.core.pending.pdus:
            if now < self._steady_until:
                self._steady_until = now + interval
            return
        if now - self._window_start >= interval:
            self._window_start, self._window_pdus = now, 0
        self._window_pdus += len(batch.pdus)
        busy = self._window_pdus >= self.config.busy_min_pdus
        self._steady_until = now + interval if busy else 0.0

    async def _catch_up(self, step: NeedCatchup, now: int) -> None:
        c = self.core
        plans = []
        if not step.exhausted:
            async with self.db_slots:
                plans = await self.store.plan_catchup(
                    self.destination,
                    self.config.server_name,
                    step.after,
                    step.cursor,
                    self.config.catchup_rooms_per_batch,
                    self.config.catchup_max_gap_events,
                )
        if plans:
            c.offer_catchup(plans, len(plans) < self.config.catchup_rooms_per_batch)
            self.observer.catchup_progress(
                self.destination, len(plans), sum(len(p.events) for p in plans)
            )
            return
        eff = c.catchup_finished()
        if eff.last_successful is not None:
            async with self.db_slots:
                await self.store.persist(self.destination, eff, None, now)

    async def _send(self, txn: FrozenTxn) -> None:
        batch = txn.batch
        if batch and not self._may_send():
            log.info("no longer allowed to send to %s (lease lost); stopping its queue",
                     self.destination)
            self._stopping = True
            return
        if not batch:
            await self._send_spanned(txn, None)
            return
        # The global transaction slot comes first: while thousands of queues wait for
        # one of ``max_concurrent_transactions``, none holds an open span or a built
        # request, and the span measures the attempt rather than the wait.
        self._note_sent(txn)  # before any wait: what is pending now is what it left
        slot = await self.txn_slots.hold()
        try:
            with log_context(txn_id=txn.txn_id), self.observer.attempt(
                    self.destination, txn.txn_id, len(batch.pdus), len(batch.edus),
                    batch.catchup):
                await self._send_spanned(txn, slot)
        finally:
            slot.release()

    async def _send_spanned(self, txn: FrozenTxn, slot: Held | None) -> None:
        """Send (or, for an empty catch-up batch, advance locally), then hand the
        result to the group commit and report it. ``slot``, held for a batch, is
        given back as soon as the request is answered."""
        c = self.core
        batch = txn.batch
        started_ms = time_ms(self.clock)
        if not batch:
            # A catch-up batch whose rooms had nothing to send: advance locally.
            result = SendResult(Outcome.SUCCESS)
        else:
            request = Transaction(
                destination=self.destination,
                txn_id=txn.txn_id,
                pdus=batch.pdu_json(),
                edus=batch.edu_json(),
                pdu_bytes=batch.pdu_bytes(),
            )
            assert slot is not None
            try:
                result = await self._attempt(request)
            finally:
                slot.release()  # the commit below needs no slot
        now = time_ms(self.clock)
        was_failing = c.backoff.retry_interval_ms > 0
        eff = c.on_result(txn, result, now)
        log_row = log_row_for(
            txn, self.destination, self.config.instance_name, result, started_ms
        ) if batch else None
        # Persisting is pipelined: the next transactions may go out while up to
        # ``MAX_UNPERSISTED`` results are written (group-committed with other
        # destinations' results). Safe: a crash before the write only means resending
        # (receivers deduplicate), and writes of one destination commit in order.
        # One deep was not enough: every queue then waited for the same commit, and
        # sending stopped altogether while it ran.
        await self._flush_persist(MAX_UNPERSISTED - 1)
        fut = self.store.submit(self.destination, eff, log_row, now)
        if fut is not None:
            self._unpersisted.append(fut)
            if batch:
                self.observer.persisting(self.destination, fut)
        if batch:
            self.observer.transaction_sent(
                self.destination,
                txn.txn_id,
                result.outcome,
                result.status,
                len(batch.pdus),
                len(batch.edus),
                Counter(e.edu_type for e in batch.edus) if batch.edus else _NO_EDUS,
                result.request_bytes or batch.size_bytes,
                result.duration_s,
                batch.catchup,
            )
        report(self.observer, self.destination, eff, result, was_failing)
        if batch and result.outcome is Outcome.SUCCESS:
            await self._pace(batch, result)

    async def _pace(self, batch: Batch, result: SendResult) -> None:
        """Pacing (``queue/pacing.py``): once a room has ``confirm_after`` PDUs the
        receiver accepted but may not have processed yet, wait until it holds the
        newest of them, so that its staging queue of the room never fills up.
        Bounded by the policy's deadline; past it, send on as without pacing."""
        pacing = self.config.pacing
        probe = self.sender
        if not isinstance(probe, EventProbe) or not pacing.paced_after(
                self._pacing_failed_at, self.clock.monotonic_s()):
            return
        pacer = self._pacer
        if pacer is None:
            pacer = self._pacer = RoomPacer(pacing)
        pacer.sent(batch, result.pdu_errors)
        while (due := pacer.to_confirm()) is not None and not self._stopping:
            room_id, event_id = due
            if not await self._confirm(probe, event_id):
                pacer.forget()
                return
            pacer.confirmed(room_id)

    async def _confirm(self, probe: EventProbe, event_id: str) -> bool:
        """Ask the receiver for ``event_id`` until it holds it or the deadline passes."""
        pacing = self.config.pacing
        t0 = self.clock.monotonic_s()
        answer = EventHeld.NO_ANSWER
        for delay in pacing.poll_delays():
            left = pacing.deadline_s - (self.clock.monotonic_s() - t0)
            if left <= 0 or self._stopping:
                break
            try:
                async with asyncio.timeout(min(left, self.config.attempt_deadline_s)):
                    answer = await probe.event_persisted(self.destination, event_id)
            except TimeoutError:
                answer = EventHeld.NO_ANSWER
            if answer is EventHeld.YES or answer is EventHeld.UNSUPPORTED:
                break
            left = pacing.deadline_s - (self.clock.monotonic_s() - t0)
            self._waiting = True  # on the clock: quiescent (a stop ends it within 1 s)
            try:
                await self.clock.sleep(max(0.0, min(delay, left)))
            finally:
                self._waiting = False
        waited = self.clock.monotonic_s() - t0
        if answer is EventHeld.YES:
            self.observer.pacing_confirmed(self.destination, "confirmed", waited)
            return True
        if self._stopping:
            return False
        self._pacing_failed_at = self.clock.monotonic_s()
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

    async def _attempt(self, request: Transaction) -> SendResult:
        """One attempt (under the global slot its caller holds), within the attempt
        deadline."""
        limit = self.config.attempt_deadline_s
        t0 = self.clock.monotonic_s()
        self._in_flight_since = t0
        try:
            async with asyncio.timeout(None) as timeout:
                self._deadline.watch(timeout)
                try:
                    result = await self.sender.send_transaction(request)
                finally:
                    self._deadline.unwatch()
        except TimeoutError:
            result = SendResult(
                Outcome.TRANSIENT,
                error=f"no answer within {limit:g}s",
                duration_s=self.clock.monotonic_s() - t0,
            )
        finally:
            self._in_flight_since = None
        if result.duration_s <= 0:
            result = replace(result, duration_s=self.clock.monotonic_s() - t0)
        return result

    async def _flush_persist(self, keep: int = 0) -> None:
        """Wait until at most ``keep`` results are uncommitted; a failed write surfaces
        here (and fails the queue, whose supervisor restarts it in catch-up mode)."""
        q = self._unpersisted
        while q and (len(q) > keep or q[0].done()):
            await q.pop(0)
