"""The per-destination queue object and the asyncio shell around its
:class:`DestinationCore`. As Synapse's ``PerDestinationQueue.send_pdu`` and Dendrite's
``destinationQueue.sendEvent``, its ``add_*`` methods add to the core and wake the loop;
the manager and the registry call its methods only, never the core's.

The loop reads the database, sends (:mod:`~federation_sender.queue.attempt`), sleeps
and persists; it decides nothing. The core says what to do next (with nothing in
flight, send what is pending at once) and when the loop exits
(:mod:`~federation_sender.queue.core.loop_policy`): empty for ``idle_ttl_s``, or about to
back off for longer than that with nothing in memory (the wake-up sweep recreates it
from the database). Every added item sets ``wake``, which cuts any wait short.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from types import MappingProxyType

from federation_sender.aio.idle import IdleSignal
from federation_sender.aio.slots import Held, Slots
from federation_sender.aio.timing import Wakeup, wait_or_timeout
from federation_sender.clock import Clock, time_ms
from federation_sender.queue.attempt import TimedAttempts
from federation_sender.queue.coalesce import HandOverGate
from federation_sender.queue.confirm import Confirmations
from federation_sender.queue.core.batching import Batch
from federation_sender.queue.core.destination import DestinationCore
from federation_sender.queue.core.items import JsonDict, PduItem
from federation_sender.queue.core.states import DestinationState
from federation_sender.queue.core.status import DestinationStatus, live_status
from federation_sender.queue.core.steps import (
    AwaitConfirmation,
    FrozenTxn,
    Idle,
    NeedCatchup,
    NeedOutbox,
    ProbeReturn,
    Send,
    Wait,
)
from federation_sender.queue.observer import QueueObserver, report
from federation_sender.queue.persistence import QueuePersistence, log_row_for
from federation_sender.queue.runner_config import RunnerConfig
from federation_sender.queue.send_time import filter_at_send
from federation_sender.telemetry.logging import log_context
from federation_sender.transport.result import (
    EventProbe,
    Outcome,
    SendResult,
    ServerProbe,
    Transaction,
    TransactionSender,
)

log = logging.getLogger(__name__)

_NO_EDUS: Mapping[str, int] = MappingProxyType({})

MAX_UNPERSISTED = 8
"""Results of one queue that may await their commit while it goes on sending."""


class DestinationRunner:
    # Slotted: one per live queue, thousands of them in a spike.
    __slots__ = (
        "_attempts", "_finished", "_idle", "_loaded", "_may_send", "_pacing", "_probe", "_recheck",
        "_stopping",
        "_unpersisted", "_up_probe", "_waiting", "clock", "config", "core", "db_slots",
        "destination", "gate", "observer", "sender", "store", "txn_slots", "wake",
    )

    def __init__(
        self,
        core: DestinationCore,
        store: QueuePersistence,
        sender: TransactionSender,
        txn_slots: Slots,
        db_slots: Slots,
        clock: Clock,
        observer: QueueObserver,
        config: RunnerConfig,
        gate: HandOverGate | None = None,
        idle: IdleSignal | None = None,
    ) -> None:
        self.core = core
        self._idle = idle or IdleSignal()
        """Raised when the loop starts waiting and when it ends (see :attr:`quiescent`)."""
        self.gate = gate
        self.destination = core.destination
        self.store = store
        self.sender = sender
        # Asked once: isinstance() of a runtime-checkable Protocol costs microseconds.
        self._probe = sender if isinstance(sender, EventProbe) else None
        self._up_probe = sender if isinstance(sender, ServerProbe) else None
        self._attempts = TimedAttempts(sender, clock, config.attempt_deadline_s)
        self.txn_slots = txn_slots
        self.db_slots = db_slots
        self.clock = clock
        self.observer = observer
        self.config = config
        self.wake = Wakeup()
        self._pacing: Confirmations | None = None
        """Pacing's state (``queue/confirm.py``), made on the first paced success."""
        self._loaded = False
        self._recheck = False
        """The wake-up sweep saw another persisted position than ours: read it again."""
        self._stopping = False
        self._finished = False
        self._waiting = False
        """Blocked on the wake event or the clock (not reading, sending or writing)."""
        self._unpersisted: list[asyncio.Future[None]] = []
        """Results submitted to the group commit and not yet known to be committed,
        oldest first."""
        self._may_send: Callable[[], bool] = lambda: True
        """Checked before every attempt: False (e.g. the shard lease lapsed) stops the
        queue before it sends; the transaction stays owed in the database."""

    # --- add and wake (what the manager and the registry may ask) ------------------------

    def poke(self) -> None:
        """Wake the loop (with nothing in flight, it sends what it holds at once)."""
        self.wake.set()

    def add_pdus(self, items: Sequence[PduItem]) -> None:
        self.core.add_pdus(items)
        self.wake.set()  # poke(), inlined: once per hand-over per destination

    def add_edu(self, edu_type: str, content: JsonDict, key: Hashable | None = None) -> None:
        self.core.add_edu(edu_type, content, key)
        self.poke()

    def add_presence(self, states: Iterable[JsonDict]) -> None:
        self.core.add_presence(states)
        self.poke()

    def add_receipt(
        self, room_id: str, receipt_type: str, user_id: str, data: JsonDict, *, wake: bool = True
    ) -> None:
        """``wake=False``: the receipt rides on the queue's next transaction."""
        self.core.add_receipt(room_id, receipt_type, user_id, data)
        if wake:
            self.poke()

    def poke_outbox(self) -> None:
        """New to-device or device-list rows: read the outboxes again, now."""
        self.core.poke_outbox()
        self.poke()

    def swept(self, persisted: int | None) -> None:
        """The wake-up sweep found rows past ``persisted``, the position in the database
        as it read it. Unlike ours, it is read again once none of our writes is pending
        (another process may have lowered it: ``batch audit --repair``)."""
        if self._loaded and (-1 if persisted is None else persisted) != self.core.last_successful:
            self._recheck = True
        self.poke()

    def wake_if_owed(self) -> bool:
        """Start a transaction for what the queue holds; False if it holds nothing."""
        if self.core.is_empty():
            return False
        self.poke()
        return True

    def clear_backoff(self, wake: bool = True) -> bool:
        """Forget the backoff (and any pause) in memory, and send at once unless ``wake``
        is False; True if the queue was held back."""
        held_back = self.core.clear_backoff()
        if wake:
            self.poke()
        return held_back

    @property
    def last_error(self) -> str | None:
        return self.core.last_error

    def left_clean(self) -> bool:
        """Nothing owed is left in memory or to catch up (after a clean exit)."""
        return not self.core.catching_up and self.core.is_empty()

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
        if not self.core.evict_if_idle(now_s, ttl_s):
            return False
        self.wake.set()
        return True

    def mark_stopped(self) -> None:
        if self.core.sm.state is not DestinationState.STOPPED:
            self.core.stop()

    @property
    def quiescent(self) -> bool:
        """Waiting for a wake-up or the clock, nothing in flight or unpersisted (a wake-up
        already set is work the loop has not picked up yet). Each change to it from
        busy raises the :class:`IdleSignal` the runner was given."""
        return self._finished or (
            self._waiting and not self.wake.is_set()
            and not any(not f.done() for f in self._unpersisted)
            and (self._pacing is None or self._pacing.quiet)
        )

    def owes_something(self) -> bool:
        """Items in memory or in flight, or a catch-up under way."""
        c = self.core
        return bool(c.pending_pdus or c.pending_edus or c.current is not None or c.catching_up)

    def in_flight_since(self) -> float | None:
        """Monotonic start of the attempt in flight, None when there is none."""
        return self._attempts.in_flight_since

    def retry_at_ms(self) -> tuple[int, int] | None:
        """(retry at, interval) of a persisted backoff, for parking the destination."""
        at = self.core.backoff.retry_at_ms
        if at is None or self._stopping:
            return None
        return at, self.core.backoff.retry_interval_ms

    def status(self, now_s: float) -> DestinationStatus:
        return live_status(self.core, self._attempts.in_flight_since, now_s)

    # --- the loop ------------------------------------------------------------------------

    async def run(self) -> None:
        # The registry, which runs every runner, puts the destination in the log context.
        try:
            await self._run()
        finally:
            self._attempts.close()
            if self._pacing is not None:
                self._pacing.close()
            self._finished = True
            self._idle.went_idle()

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
        self._idle.went_idle()
        try:
            if timeout_s is None:
                await self.wake.wait()  # no helper task: idle waits are the common case
            else:
                await wait_or_timeout(self.clock, self.wake, timeout_s)
        finally:
            self._waiting = False

    async def _bootstrap(self) -> None:
        """Read the queue's row, outbox window and (in catch-up) first catch-up plans and
        load them into the core. Outside catch-up the read is gathered with those of
        every queue starting meanwhile (``QueuePersistence.bootstrap_gathered``)."""
        c = self.core
        c.outbox_read_started()
        cfg = self.config
        if not c.catching_up:
            # Gathered with every queue starting meanwhile (one read at a time: no slot).
            boot = await self.store.bootstrap_gathered(self.destination, cfg.outbox_read_limit)
        else:
            async with self.db_slots:
                boot = await self.store.bootstrap_catchup(
                    self.destination, cfg.server_name, cfg.outbox_read_limit,
                    cfg.catchup_rooms_per_batch, cfg.catchup_max_gap_events,
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
            if self._recheck:
                await self._recheck_position()
            now = time_ms(self.clock)
            gate = self.gate
            if gate is not None and gate.behind and c.would_send_partial_pdus(now):
                # The fan-out is behind: a fuller transaction (coalesce.py).
                await gate.hold(lambda: c.would_send_partial_pdus(time_ms(self.clock)))
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
            elif isinstance(step, ProbeReturn):
                await self._probe_return()
            elif isinstance(step, AwaitConfirmation):
                # The confirmations' task wakes the loop (a room confirmed, or pacing
                # given up); a new item does too.
                conf = self._pacing
                if conf is not None and self._probe is not None:
                    conf.keep_asking(self._probe, lambda: self._stopping, self.wake.set)
                await self._wait(None)
            elif isinstance(step, Wait):
                wait_s = max(0.0, (step.until_ms - now) / 1000.0)
                if c.parks(wait_s, self.config.idle_ttl_s):
                    return  # nothing in memory: the wake-up sweep brings us back
                await self._wait(wait_s)
            elif isinstance(step, Idle):
                if c.stopped:
                    return
                # No timer here: the manager's housekeeping evicts queues idle past the
                # TTL through ``evict_if_idle`` (one clock task for all queues).
                c.idle_started(self.clock.monotonic_s())
                await self._wait(None)
                if c.idle_ended():
                    return

    async def _recheck_position(self) -> None:
        """Read the persisted position with none of our writes pending and adopt it
        (:meth:`DestinationCore.position_read`): lower, the queue catches up from it."""
        self._recheck = False
        await self._flush_persist()
        async with self.db_slots:
            _, persisted = await self.store.load_destination(self.destination)
        before = self.core.last_successful
        eff = self.core.position_read(persisted)
        if self.core.last_successful < before:
            log.info("the position of %s was lowered from %d to %d by another process "
                     "(batch audit --repair); sending what is past it in catch-up mode",
                     self.destination, before, self.core.last_successful)
        if eff.entered_catchup:
            self.observer.catchup_entered(self.destination, eff.dropped_for_catchup)

    async def _probe_return(self) -> None:
        """The core asks whether the destination, in its persisted backoff, is back
        (``queue/core/destination.py``, the return probe): one ``GET`` of its version,
        bounded by the attempt deadline; when it answers, the next step sends."""
        up = False
        if self._up_probe is not None and self._may_send():
            try:
                async with asyncio.timeout(self.config.attempt_deadline_s):
                    up = await self._up_probe.server_answers(self.destination)
            except TimeoutError:
                up = False
        if self.core.on_return_probe(up, time_ms(self.clock)):
            log.info("%s answers again during its backoff: sending now", self.destination)
        self.observer.return_probe(self.destination, up)

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
                    c.episode.room_floor,
                    step.skip_rooms,
                )
        if step.skip_rooms:
            # Beside rooms awaiting a confirmation: neither the end of the episode nor
            # of its reads.
            c.offer_catchup(plans, side=True, limit=self.config.catchup_rooms_per_batch)
            if plans:
                self.observer.catchup_progress(
                    self.destination, len(plans), sum(len(p.events) for p in plans))
            return
        if plans:
            c.offer_catchup(plans, len(plans) < self.config.catchup_rooms_per_batch)
            self.observer.catchup_progress(
                self.destination, len(plans), sum(len(p.events) for p in plans)
            )
            return
        eff = c.catchup_finished()
        if eff.last_successful is not None:
            # The episode's own transactions' writes first: the episode's end is written
            # alone (not group-committed behind them), and if one of them failed, the
            # queue fails here and restarts in catch-up rather than move its position.
            await self._flush_persist()
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
        held = await self._held_already(batch) if batch.catchup else frozenset[str]()
        slot = await self.txn_slots.hold()
        try:
            with log_context(txn_id=txn.txn_id), self.observer.attempt(
                    self.destination, txn.txn_id, len(batch.pdus), len(batch.edus),
                    batch.catchup):
                await self._send_spanned(txn, slot, held)
        finally:
            slot.release()

    async def _held_already(self, batch: Batch) -> frozenset[str]:
        """The PDUs of catch-up pages the receiver already holds (``queue/confirm.py``)."""
        conf = self._confirmations()
        if conf is None or self._probe is None:
            return frozenset()
        return await conf.held_already(self._probe, batch)

    async def _send_spanned(self, txn: FrozenTxn, slot: Held | None,
                            held: frozenset[str] = frozenset()) -> None:
        """Send (or, for an empty catch-up batch, advance locally), then hand the
        result to the group commit and report it. ``slot``, held for a batch, is
        given back as soon as the request is answered."""
        c = self.core
        batch = txn.batch
        started_ms = time_ms(self.clock)
        sent = Batch(tuple(p for p in batch.pdus if p.event_id not in held),
                     batch.edus) if held else batch
        if sent.pdus and self.config.send_time_filter:
            # Erased senders' PDUs withheld, redacted ones pruned (send_time.py). No
            # db slot: the backend reads one at a time, gathering the queues' questions.
            sent = await filter_at_send(sent, self.store.storage, self.observer,
                                        self.destination)
        if not sent:
            # A catch-up batch whose rooms had nothing to send, or whose every PDU the
            # receiver holds or send_time.py withholds: advance locally.
            result = SendResult(Outcome.SUCCESS)
            if slot is not None:
                slot.release()
        else:
            request = Transaction(destination=self.destination, txn_id=txn.txn_id,
                                  pdus=sent.pdu_json(), edus=sent.edu_json(),
                                  pdu_bytes=sent.pdu_bytes())
            assert slot is not None
            try:
                result = await self._attempts.send(request)
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
                self.destination, txn.txn_id, result.outcome, result.status,
                len(batch.pdus), len(batch.edus),
                Counter(e.edu_type for e in batch.edus) if batch.edus else _NO_EDUS,
                result.request_bytes or batch.size_bytes, result.duration_s, batch.catchup,
            )
        report(self.observer, self.destination, eff, result, was_failing)
        if batch and result.outcome is Outcome.SUCCESS:
            # Pacing waits only for what went out: not for PDUs the receiver held
            # already, nor for those withheld at send time.
            self._pace(sent if sent is batch else Batch(sent.pdus, sent.edus, batch.catchup),
                       result)

    def _confirmations(self) -> Confirmations | None:
        """Pacing's state, made on first use (None: pacing off, or no probe)."""
        if self._probe is None or not self.config.pacing.enabled:
            return None
        if self._pacing is None:
            self._pacing = Confirmations(self.destination, self.config.pacing, self.clock,
                                         self.observer, self.config.attempt_deadline_s,
                                         self._idle)
            self.core.held_rooms = self._pacing.held  # the composer leaves their PDUs
        return self._pacing

    def _pace(self, batch: Batch, result: SendResult) -> None:
        """Pacing (``queue/confirm.py``): the rooms now due wait for the receiver's
        confirmation, asked for beside this loop; the other rooms' PDUs go on."""
        conf = self._confirmations()
        if conf is not None and self._probe is not None and conf.paced():
            conf.after_success(self._probe, batch, result, lambda: self._stopping,
                               self.wake.set)

    async def _flush_persist(self, keep: int = 0) -> None:
        """Wait until at most ``keep`` results are uncommitted (a failed write surfaces
        here and fails the queue, whose supervisor restarts it in catch-up mode)."""
        q = self._unpersisted
        while q and (len(q) > keep or q[0].done()):
            await q.pop(0)
