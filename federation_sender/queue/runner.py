"""The asyncio shell around one :class:`DestinationCore`: reads the database, sends
transactions, sleeps, persists. It decides nothing itself.

The loop exits (and the manager forgets the queue) when the core has been empty for
``idle_ttl_s``, or when it would back off for longer than that with nothing held in
memory: everything it needs later is in the database, and the wake-up sweep recreates
it. ``wake`` cuts any wait short (new work, REMOTE_SERVER_UP, shutdown).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType

from federation_sender.clock import Clock, time_ms
from federation_sender.queue.core import (
    DestinationCore,
    Effects,
    FrozenTxn,
    Idle,
    NeedCatchup,
    NeedOutbox,
    Send,
    Wait,
)
from federation_sender.queue.observer import QueueObserver
from federation_sender.queue.slots import Slots
from federation_sender.queue.store import QueueStore, log_row_for
from federation_sender.queue.timing import wait_or_timeout
from federation_sender.transport.result import (
    Outcome,
    SendResult,
    Transaction,
    TransactionSender,
)

log = logging.getLogger(__name__)

_NO_EDUS: Mapping[str, int] = MappingProxyType({})

MAX_UNPERSISTED = 8
"""Results of one queue that may await their commit while it goes on sending."""


@dataclass(frozen=True, slots=True)
class RunnerConfig:
    server_name: str
    instance_name: str
    attempt_deadline_s: float
    idle_ttl_s: float
    catchup_rooms_per_batch: int
    catchup_max_gap_events: int
    outbox_read_limit: int


class DestinationRunner:
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
    ) -> None:
        self.core = core
        self.destination = core.destination
        self.store = store
        self.sender = sender
        self.txn_slots = txn_slots
        self.db_slots = db_slots
        self.clock = clock
        self.observer = observer
        self.config = config
        self.wake = asyncio.Event()
        self.in_flight_since: float | None = None
        self.loaded = False
        self.stopping = False
        self.finished = False
        self._unpersisted: deque[asyncio.Future[None]] = deque()
        """Results submitted to the group commit and not yet known to be committed,
        oldest first."""
        self.idle_since: float | None = None
        """Monotonic time the queue went idle (None while busy)."""
        self.evict = False
        self.deadline_hit = False
        self.may_send: Callable[[], bool] = lambda: True
        """Checked before every attempt: False (e.g. the shard lease lapsed) stops the
        queue before it sends; the transaction stays owed in the database."""

    def poke(self) -> None:
        self.wake.set()

    async def run(self) -> None:
        try:
            await self._loop()
        finally:
            # Let the submitted results reach the database even when cancelled (the
            # group commit writes them in submission order: the newest is the last).
            pending = [f for f in self._unpersisted if not f.done()]
            if pending:
                await asyncio.shield(asyncio.gather(*pending, return_exceptions=True))
        await self._flush_persist()  # a normal exit: a failed write still surfaces

    async def _loop(self) -> None:
        c = self.core
        if not self.loaded:
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
            self.loaded = True
            if eff.dropped_for_catchup:
                self.observer.catchup_entered(self.destination, eff.dropped_for_catchup)
            else:
                c.add_outbox(boot.to_device, boot.device_lists, boot.outbox_exhausted)
                if boot.plans and c.catching_up:
                    c.offer_catchup(
                        boot.plans, len(boot.plans) < self.config.catchup_rooms_per_batch
                    )
                elif boot.plans == [] and c.catching_up:
                    done = c.catchup_finished()
                    if done.last_successful is not None:
                        await self.store.persist(self.destination, done, None, time_ms(self.clock))
        while not self.stopping:
            self.wake.clear()
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
                if step.exhausted:
                    plans = []
                else:
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
                else:
                    eff = c.catchup_finished()
                    if eff.last_successful is not None:
                        async with self.db_slots:
                            await self.store.persist(self.destination, eff, None, now)
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
                await wait_or_timeout(self.clock, self.wake, wait_s)
            elif isinstance(step, Idle):
                if c.stopped:
                    return
                # No timer here: the manager's housekeeping evicts queues idle past the
                # TTL by setting ``evict`` and waking us (one clock task for all queues).
                self.idle_since = self.clock.monotonic_s()
                await self.wake.wait()
                self.idle_since = None
                if self.evict and c.is_empty():
                    return
                self.evict = False

    async def _send(self, txn: FrozenTxn) -> None:
        c = self.core
        batch = txn.batch
        if batch and not self.may_send():
            log.info("no longer allowed to send to %s (lease lost); stopping its queue",
                     self.destination)
            self.stopping = True
            return
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
            )
            async with self.txn_slots:
                t0 = self.clock.monotonic_s()
                self.in_flight_since = t0
                try:
                    result = await self.sender.send_transaction(request)
                except asyncio.CancelledError:
                    # The manager's watchdog cancels attempts past their deadline.
                    if not self.deadline_hit:
                        raise
                    task = asyncio.current_task()
                    if task is not None:
                        task.uncancel()
                    result = SendResult(
                        Outcome.TRANSIENT,
                        error=f"no answer within {self.config.attempt_deadline_s:g}s",
                        duration_s=self.clock.monotonic_s() - t0,
                    )
                finally:
                    self.in_flight_since = None
                    self.deadline_hit = False
            if result.duration_s <= 0:
                result = replace(result, duration_s=self.clock.monotonic_s() - t0)
        now = time_ms(self.clock)
        eff = c.on_result(txn, result, now)
        log_row = None
        if batch:
            log_row = log_row_for(
                txn_id=txn.txn_id,
                destination=self.destination,
                instance_name=self.config.instance_name,
                pdu_event_ids=[p.event_id for p in batch.pdus],
                edu_count=len(batch.edus),
                request_bytes=result.request_bytes or batch.size_bytes,
                status=result.outcome.value,
                http_status=result.status,
                started_ts=started_ms,
                duration_ms=int(result.duration_s * 1000),
                catchup=batch.catchup,
                max_stream_ordering=batch.max_stream_ordering,
                error=result.error or None,
            )
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
        self._report(eff, result)

    async def _flush_persist(self, keep: int = 0) -> None:
        """Wait until at most ``keep`` results are uncommitted; a failed write surfaces
        here (and fails the queue, whose supervisor restarts it in catch-up mode)."""
        q = self._unpersisted
        while q and (len(q) > keep or q[0].done()):
            await q.popleft()

    def _report(self, eff: Effects, result: SendResult) -> None:
        d = self.destination
        if eff.backoff is not None:
            self.observer.backoff_changed(d, eff.backoff.retry_interval_ms / 1000.0)
            if eff.backoff.retry_interval_ms:
                log.info(
                    "destination %s failed (%s); backing off %.0fs",
                    d,
                    result.error or result.outcome.value,
                    eff.backoff.retry_interval_ms / 1000.0,
                )
        for item, reason in eff.dropped:
            kind = "pdu" if hasattr(item, "event_id") else getattr(item, "edu_type", "edu")
            ident = getattr(item, "event_id", None) or kind
            log.warning("dropping %s %s for %s: %s (last error: %s)",
                        kind, ident, d, reason, result.error or result.status)
            self.observer.item_dropped(d, kind, reason)
        if eff.entered_catchup:
            log.info("destination %s enters catch-up, %d items dropped from memory",
                     d, eff.dropped_for_catchup)
            self.observer.catchup_entered(d, eff.dropped_for_catchup)
        if result.pdu_errors:
            log.info("destination %s rejected %d PDUs in a 200: %s", d, len(result.pdu_errors),
                     dict(list(result.pdu_errors.items())[:5]))
