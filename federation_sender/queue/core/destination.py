"""The sans-I/O core of one destination queue.

The asyncio shell (:mod:`federation_sender.queue.runner`) repeatedly asks
:meth:`DestinationCore.next_step` what to do, performs it (sleep, read the database,
send a transaction) and feeds the outcome back. Everything that decides anything lives
here: what to do next (:data:`NEXT_STEP`, a table) and what a transaction's result
implies (:meth:`DestinationCore.on_result`), so it is tested synchronously, including by
a Hypothesis state machine.

Invariants:

* At most one transaction is in flight (``current``); it is frozen, with its txn id,
  from the moment it is built until a 200, a split, or a fall back to catch-up. Retries
  resend identical content under the identical id.
* ``last_successful_stream_ordering`` only advances to a position below every PDU
  still held in memory (pending, queued halves, quarantine), so a crash never skips a
  PDU that was not delivered: catch-up resumes from there.
* In catch-up mode (:class:`~federation_sender.queue.core.episode.CatchupEpisode`) no PDU
  is held in memory, and the position moves only when an episode ends.
* Refusals are judged by :class:`~federation_sender.queue.core.isolation.ItemIsolation`
  (split, quarantine with spaced retries, probe, drop only with successes in between,
  or blame the destination).
* A 429 pauses the queue briefly (:class:`~federation_sender.queue.core.backoff.RateLimit`),
  longer at each 429 in a row whatever the peer's hint; past a bound 429s are failures.
  Every real success reports ``succeeded`` (the store resets the persisted backoff,
  whoever wrote it).
* A destination that does not answer (no connection, a timeout, a 5xx) is first retried
  in memory (:class:`~federation_sender.queue.core.backoff.ShortRetry`: every 2 s or sooner
  for 30 s, then Synapse's in-request schedule) with the same frozen transaction; only
  when that phase is over is the backoff persisted. An answer of any kind ends the
  phase; a wake-up (``clear_backoff``) cuts its wait short without resetting its count.
* When to send is decided here (:data:`NEXT_STEP`): with nothing in flight and nothing
  paused, the pending items go at once, however little (no hold of its own); what
  arrives while a transaction is in flight goes, all of it within the limits, in the
  next one. When the runner exits (idle past the TTL:
  :class:`~federation_sender.queue.core.loop_policy.LoopPolicy`, or parked in a long
  backoff: :meth:`DestinationCore.parks`) is decided here too.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Hashable, Iterable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from federation_sender.model import EventRow
from federation_sender.queue.core.backoff import (
    RESET,
    BackoffPolicy,
    BackoffState,
    RateLimit,
    ShortRetry,
)
from federation_sender.queue.core.batching import Batch, Limits, fill_edus
from federation_sender.queue.core.catchup import RoomPlan, pdu_item
from federation_sender.queue.core.composer import RoomRotation, compose, edus_only
from federation_sender.queue.core.effects import Effects, outbox_keys
from federation_sender.queue.core.episode import CatchupEpisode
from federation_sender.queue.core.isolation import ItemIsolation, Verdict
from federation_sender.queue.core.items import (
    EduItem,
    EduKind,
    JsonDict,
    PduItem,
    PendingItems,
    make_edu,
)
from federation_sender.queue.core.loop_policy import LoopPolicy
from federation_sender.queue.core.states import DestinationState, DestinationStateMachine
from federation_sender.queue.core.steps import (
    AwaitConfirmation,
    FrozenTxn,
    Idle,
    NeedCatchup,
    NeedOutbox,
    ProbeReturn,
    Send,
    Step,
    Wait,
)
from federation_sender.transport.result import Outcome, SendResult


class DestinationCore:
    # Slotted: one per live queue, thousands of them in a spike.
    __slots__ = (
        "_next_txn_id", "backoff", "current", "destination", "device_list_cursor",
        "episode", "held_rooms", "isolation", "last_error", "last_success_ms",
        "last_successful", "limits", "loop_policy", "max_done", "outbox_dirty", "parse_pdu",
        "pending", "policy", "rate_limit", "return_probe_last_ms", "return_seen", "rng",
        "rotation", "short_retry", "sm", "stopped", "to_device_cursor", "work",
    )

    def __init__(
        self,
        destination: str,
        policy: BackoffPolicy,
        limits: Limits,
        rng: random.Random,
        next_txn_id: Callable[[], str],
        max_item_failures: int = 3,
        max_rooms_per_txn: int = 50,
        initial_rooms_per_txn: int = 8,
        fast_answer_s: float = 1.0,
        on_state_change: Callable[[DestinationState, DestinationState], None] | None = None,
        catching_up: bool = True,
        parse_pdu: Callable[[EventRow], PduItem] = pdu_item,
        loop_policy: LoopPolicy | None = None,
        last_error: str | None = None,
    ) -> None:
        self.destination = destination
        self.parse_pdu = parse_pdu
        self.policy = policy
        self.limits = limits
        self.rng = rng
        self._next_txn_id = next_txn_id
        self.sm = DestinationStateMachine(on_state_change)
        self.pending = PendingItems()
        self.backoff: BackoffState = RESET
        self.rate_limit = RateLimit(policy.initial_s)
        self.episode = CatchupEpisode(
            catching_up, initial_rooms_per_txn, max_rooms_per_txn, fast_answer_s
        )
        self.isolation = ItemIsolation(max_item_failures)
        self.short_retry = ShortRetry(policy.short_retry)
        self.last_successful = -1
        self.max_done = -1
        self.current: FrozenTxn | None = None
        self.work: list[Batch] = []
        """Batches to send before new items, next first (a list: a deque allocates
        760 bytes even empty, with each of thousands of live queues)."""
        self.to_device_cursor = -1
        self.device_list_cursor = -1
        self.outbox_dirty = True
        self.loop_policy = loop_policy or LoopPolicy()
        self.last_error = last_error
        """The last failure's text (a new queue starts with its predecessor's)."""
        self.last_success_ms: int | None = None
        """Clock ms of the last answered non-empty transaction (since this queue loaded)."""
        self.stopped = False
        self.return_probe_last_ms = 0
        """When the last return probe was made (:meth:`on_return_probe`)."""
        self.return_seen = False
        """A return probe found the destination up: its backoff no longer holds the
        next attempt (which, failing, backs off further, without a new short-retry
        phase)."""
        self.held_rooms: AbstractSet[str] = frozenset()
        """Rooms whose PDUs wait for the receiver's confirmation (pacing,
        :class:`~federation_sender.queue.core.pacing.RoomPacer`, whose set this is once
        the shell paces the queue): the composer leaves their PDUs pending."""
        self.rotation = RoomRotation()
        """The composer's round-robin over backlogged rooms."""

    @property
    def catching_up(self) -> bool:
        """Catch-up *mode*: set for queues that may have missed events (at startup, after
        a long backoff, after a crash of their runner)."""
        return self.episode.active

    # --- loading and hand-over ---------------------------------------------------------

    def load(self, backoff: BackoffState, last_successful: int | None) -> Effects:
        """Apply the persisted state. A backoff past the catch-up threshold puts the
        queue in catch-up mode (dropping what was queued before loading)."""
        eff = Effects()
        self.backoff = backoff
        self.last_successful = -1 if last_successful is None else last_successful
        self.episode.reset(self.last_successful)
        if self.policy.should_catch_up(backoff):
            self._enter_catchup(eff)
        return eff

    def add_pdu(self, item: PduItem) -> None:
        self.add_pdus((item,))

    def add_pdus(self, items: Sequence[PduItem]) -> None:
        """Like :meth:`add_pdu` for each item; ``items`` are in stream order."""
        if not items:
            return
        if self.episode.active:
            self.episode.skipped(items[-1].stream_ordering)
            return
        if items[0].stream_ordering <= self.max_done:
            # The fan-out hands PDUs over after committing their destination_rooms rows;
            # a catch-up episode that read those rows meanwhile has sent them (or a
            # later extremity of their room) and moved max_done past them.
            items = [i for i in items if i.stream_ordering > self.max_done]
        self.pending.add_pdus(items)

    def add_edu(self, edu_type: str, content: JsonDict, key: Hashable | None = None) -> None:
        if key is not None:
            self.isolation.supersede((edu_type, key))
        self.pending.add_edu(edu_type, content, key)

    def add_presence(self, states: Iterable[JsonDict]) -> None:
        self.pending.add_presence(states)

    def add_receipt(self, room_id: str, receipt_type: str, user_id: str, data: JsonDict) -> None:
        self.pending.add_receipt(room_id, receipt_type, user_id, data)

    def poke_outbox(self) -> None:
        self.outbox_dirty = True

    def outbox_read_started(self) -> None:
        """A read of the outboxes begins: rows written from now on need another one (a
        poke that arrives while the read is in flight sets the flag again; clearing it
        when the read ends instead would lose that poke)."""
        self.outbox_dirty = False

    def add_outbox(
        self,
        to_device: Sequence[tuple[int, JsonDict]],
        device_lists: Sequence[tuple[int, str, str, str, JsonDict]],
        exhausted: bool,
    ) -> None:
        for sid, content in to_device:
            self.pending.to_device.append(
                make_edu(EduKind.TO_DEVICE, "m.direct_to_device", content, (sid, "", ""))
            )
            self.to_device_cursor = max(self.to_device_cursor, sid)
        for sid, user, device, edu_type, content in device_lists:
            self.pending.device_lists.append(
                make_edu(EduKind.DEVICE_LIST, edu_type, content, (sid, user, device))
            )
            self.device_list_cursor = max(self.device_list_cursor, sid)
        if not exhausted:
            self.outbox_dirty = True

    # --- the decision -----------------------------------------------------------------

    def retry_at_ms(self) -> int | None:
        """When sending may resume (a backoff, a 429 pause or a short retry's wait),
        None if it may now."""
        at = None if self.return_seen else self.backoff.retry_at_ms
        for paused in (self.rate_limit.until_ms, self.short_retry.until_ms):
            if paused and (at is None or paused > at):
                at = paused
        return at

    def would_send_partial_pdus(self, now_ms: int) -> bool:
        """The next step would be a new transaction of fewer PDUs than one holds, taken
        from what the fan-out handed over (no retry in flight, no catch-up, no backoff,
        nothing held for isolation): worth waiting for the fan-out's next hand-over
        when it is behind (:mod:`federation_sender.queue.coalesce`)."""
        n = len(self.pending.pdus)
        return (
            0 < n < self.limits.max_pdus
            and self.current is None
            and not self.work
            and not self.episode.active
            and not self.stopped
            and not self.backoff.active_at(now_ms)
            and not self.rate_limit.active_at(now_ms)
            and not self.short_retry.active_at(now_ms)
            and self.isolation.next_ready_ms() is None
        )

    def next_step(self, now_ms: int) -> Step:
        """The first rule of :data:`NEXT_STEP` whose condition holds and that gives a
        step decides (a rule may find nothing to do and pass to the next)."""
        for rule in NEXT_STEP:
            if rule.when(self, now_ms):
                step = rule.then(self, now_ms)
                if step is not None:
                    return step
        raise AssertionError("the last rule always gives a step")  # pragma: no cover

    def _paused(self, now_ms: int) -> bool:
        return (self.rate_limit.active_at(now_ms) or self.short_retry.active_at(now_ms)
                or (not self.return_seen and self.backoff.active_at(now_ms)))

    def _wait_out_pause(self, now_ms: int) -> Step:
        retry_at = self.retry_at_ms()
        assert retry_at is not None
        self.sm.to(DestinationState.BACKING_OFF)
        probe_at = self._return_probe_at(now_ms)
        return Wait(retry_at if probe_at is None else min(retry_at, probe_at))

    # --- the return probe: a destination in its backoff, asked whether it is back ---------

    def _owes(self) -> bool:
        return self.current is not None or bool(self.work) or bool(self.pending)

    def _return_probe_at(self, now_ms: int) -> int | None:
        """When to ask a destination held only by its persisted backoff whether it is
        back (:meth:`BackoffPolicy.return_probe_at_ms`): only with something to send,
        never during a 429 pause, a short-retry wait or catch-up (whose destinations
        have been down an hour or more, and hold nothing in memory)."""
        if (not self.backoff.backing_off or self.return_seen or self.episode.active
                or not self._owes()
                or self.rate_limit.active_at(now_ms) or self.short_retry.active_at(now_ms)):
            return None
        return self.policy.return_probe_at_ms(self.backoff, self.return_probe_last_ms, now_ms)

    def _return_probe_due(self, now_ms: int) -> bool:
        at = self._return_probe_at(now_ms)
        return at is not None and at <= now_ms

    def _probe_return(self, now_ms: int) -> Step:
        self.return_probe_last_ms = now_ms
        return ProbeReturn()

    def on_return_probe(self, up: bool, now_ms: int) -> bool:
        """The answer to :class:`ProbeReturn`: when the destination is ``up``, the next
        step sends at once. Returns ``up``."""
        self.return_probe_last_ms = max(self.return_probe_last_ms, now_ms)
        if up:
            self.return_seen = True
        return up

    def _outbox_to_read(self, _now_ms: int) -> bool:
        low = len(self.pending.to_device) + len(self.pending.device_lists) < self.limits.max_edus
        return self.outbox_dirty and low

    def _read_outbox(self, _now_ms: int) -> Step:
        self._to_sending()
        self.outbox_read_started()
        return NeedOutbox(self.to_device_cursor, self.device_list_cursor)

    def _catchup_rows_to_read(self, _now_ms: int) -> bool:
        return not self.work and self.episode.active and not self.episode.plans

    def _read_catchup_rows(self, _now_ms: int) -> Step:
        self.sm.to(DestinationState.CATCHING_UP)
        ep = self.episode
        return NeedCatchup(self.last_successful, ep.cursor, ep.exhausted)

    def _send_next_batch(self, now_ms: int) -> Step | None:
        batch = self._next_batch(now_ms)
        if batch is not None and (batch or batch.catchup_position is not None):
            # An empty catch-up batch still carries a position to advance.
            return self._send(FrozenTxn(self._next_txn_id(), batch))
        return None

    def _wait_for_quarantine(self, _now_ms: int) -> Step | None:
        ready_at = self.isolation.next_ready_ms()
        if ready_at is None:
            return None
        # Only quarantined items are left: their next retry is due then.
        self._to_sending()
        return Wait(ready_at)

    def _side_read_due(self, _now_ms: int) -> bool:
        """Catching up, and the next page's room awaits its confirmation: other rooms'
        rows may wait past the cursor (:meth:`CatchupEpisode.side_read`)."""
        ep = self.episode
        return (ep.active and ep.side_due and not self.work and bool(ep.plans)
                and ep.plans[0].room_id in self.held_rooms)

    def _read_beside(self, _now_ms: int) -> Step:
        self.sm.to(DestinationState.CATCHING_UP)
        cursor = self.episode.side_read()
        return NeedCatchup(self.last_successful, cursor, False, tuple(sorted(self.held_rooms)))

    def _held_back(self, _now_ms: int) -> bool:
        """PDUs are left, all of rooms that wait for the receiver's confirmation."""
        if not self.held_rooms:
            return False
        plans = self.episode.plans
        return bool(self.pending.pdus) or bool(plans and plans[0].room_id in self.held_rooms)

    def _await_confirmation(self, _now_ms: int) -> Step:
        self._to_sending()
        return AwaitConfirmation()

    def _go_idle(self, _now_ms: int) -> Step:
        self.sm.to(DestinationState.IDLE)
        return Idle()

    def _next_batch(self, now_ms: int) -> Batch | None:
        plans = self.episode.plans
        if not self.work and plans:
            waiting = self.held_rooms
            if plans[0].room_id in waiting:
                # The room's next page waits for its confirmation. Another room's plan
                # goes first (a read beside it planned it); else the EDUs do, or a
                # quarantined batch due.
                free = next((i for i, p in enumerate(plans) if p.room_id not in waiting),
                            None)
                if free is None:
                    edus = edus_only(self.pending, self.limits)
                    return edus if edus else self.isolation.take_ready(now_ms, False)
                plans.insert(0, plans.pop(free))
            self.work.append(
                self.episode.next_batch(self.limits, self.parse_pdu, self.held_rooms))
        if self.work:
            batch = self.work.pop(0)
            if batch.catchup and len(batch.edus) == 0:
                batch = fill_edus(batch, self.pending, self.limits)
            return batch
        held = self.isolation.take_ready(now_ms, others_waiting=bool(self.pending))
        if held is not None:
            return held
        if self.pending:
            batch = compose(self.pending, self.limits, self.held_rooms, self.rotation)
            if batch:
                return batch
            # Everything pending waits for a confirmation: a quarantined batch due goes.
            return self.isolation.take_ready(now_ms, others_waiting=False)
        return None

    def _send(self, txn: FrozenTxn) -> Send:
        self.current = txn
        self._to_sending()
        return Send(txn)

    def _to_sending(self) -> None:
        self.sm.to(
            DestinationState.CATCHING_UP if self.episode.active else DestinationState.SENDING
        )

    # --- a transaction's result (success, refusal, 429, failure, drop; the position) --

    def _min_held_stream_ordering(self) -> int | None:
        m = self.pending.min_stream_ordering()
        if not self.work and not self.isolation:
            return m
        sos = [
            p.stream_ordering
            for b in (*self.work, *self.isolation.batches())
            for p in b.pdus
        ]
        if m is not None:
            sos.append(m)
        return min(sos, default=None)

    def on_result(self, txn: FrozenTxn, result: SendResult, now_ms: int) -> Effects:
        if self.current is not txn:
            raise RuntimeError("result for a transaction that is not in flight")
        eff = Effects()
        batch = txn.batch
        phase = self.short_retry
        if phase.in_phase and batch:
            phase.attempts += 1
            eff.short_retry_attempt = True
            if not _unanswered(result):
                # Any answer but a 5xx: the destination is up again.
                eff.short_retry_long = phase.long_retries
                eff.short_retry_ended = phase.reset()
        if result.outcome is Outcome.SUCCESS:
            if batch:
                self.last_success_ms = now_ms
            self._on_success(batch, result, eff)
            return eff
        self.last_error = result.error or result.outcome.value
        if result.outcome is Outcome.TOO_LARGE:
            self.current = None
            if batch.item_count >= 2:
                self.work[:0] = batch.split()
            else:
                self._drop(batch, "too_large", eff)
            return eff
        if result.status == 429:
            first = self.rate_limit.in_a_row == 0
            if self.rate_limit.on_429(result.retry_after_s, now_ms):
                # Overloaded, not failed: resend the same transaction after a pause.
                if first:
                    eff.rate_limited_ms = self.rate_limit.until_ms - now_ms
                self.current = FrozenTxn(txn.txn_id, batch, txn.attempts + 1)
                return eff
        if self.isolation.is_refusal(result.status, batch):
            verdict = self.isolation.on_refusal(batch, result.status, now_ms)
            if verdict is not Verdict.DESTINATION:
                self.current = None
                if batch.item_count >= 2:  # SPLIT, or PROBE after many refusals
                    self.work[:0] = batch.split()
                if verdict is Verdict.PROBE:
                    self.work.insert(0, Batch((), (), probe=True))
                elif verdict is Verdict.DROP:
                    self._drop(batch, "refused", eff)
                return eff
        self._fail(txn, result, now_ms, eff)
        return eff

    def _on_success(self, batch: Batch, result: SendResult, eff: Effects) -> None:
        self.current = None
        self.return_seen = False
        if batch:
            # Only an answer clears it: an empty catch-up step advancing locally says
            # nothing about the destination.
            self.last_error = None
        if self.rate_limit.in_a_row:
            eff.rate_limit_ended = self.rate_limit.in_a_row
            self.rate_limit.on_success()
        self.isolation.on_success(batch)
        eff.succeeded = bool(batch)
        if self.backoff != RESET:
            self.backoff = RESET
            eff.backoff = RESET
        outbox_keys(batch.edus, eff)
        eff.prune.extend(batch.catchup_prune)
        if batch.catchup:
            self.episode.answered(result.duration_s)
        if not self.episode.active:
            # Catch-up moves the position only when the episode ends: until then
            # rooms not yet handled may hold missed events below any row handled.
            self._advance(batch, eff)

    def _fail(self, txn: FrozenTxn, result: SendResult, now_ms: int, eff: Effects) -> None:
        """The destination is down (or refuses everything): retry soon (the short-retry
        phase) or back off, keeping the frozen transaction for an identical retry."""
        self.isolation.on_destination_failure()
        self.current = FrozenTxn(txn.txn_id, txn.batch, txn.attempts + 1)
        # An attempt a return probe let through failed: back off further (the backoff
        # is still set, so no new short-retry phase begins).
        self.return_seen = False
        phase = self.short_retry
        if _unanswered(result) and not self.backoff.backing_off:
            first = not phase.in_phase
            retries, long_retries = phase.attempts, phase.long_retries
            delay = phase.on_failure(now_ms, self.rng)
            if delay is not None:
                eff.short_retry_ms = delay
                eff.short_retry_started = first
                return
            if not first:
                eff.short_retry_gave_up = retries
                eff.short_retry_long = long_retries
        elif phase.in_phase:
            eff.short_retry_long = phase.long_retries
            eff.short_retry_gave_up = phase.reset()
        self.backoff = self.policy.on_failure(
            self.backoff, now_ms, self.rng, result.retry_after_s
        )
        eff.backoff = self.backoff
        if self.policy.should_catch_up(self.backoff):
            self._enter_catchup(eff)

    def _drop(self, batch: Batch, reason: str, eff: Effects) -> None:
        items: list[PduItem | EduItem] = [*batch.pdus, *batch.edus]
        eff.dropped.extend((item, reason) for item in items)
        self.isolation.forget(batch)
        # A dropped outbox row is marked sent so it cannot poison the queue again.
        outbox_keys(batch.edus, eff)
        eff.prune.extend(batch.catchup_prune)
        if not self.episode.active:
            self._advance(batch, eff)

    def _advance(self, batch: Batch, eff: Effects) -> None:
        """Move the position up to the highest PDU done (sent or dropped), but below any
        PDU still held in memory."""
        top = batch.max_stream_ordering
        if top is not None:
            self.max_done = max(self.max_done, top)
        target = self.max_done
        held = self._min_held_stream_ordering()
        if held is not None:
            target = min(target, held - 1)
        if target > self.last_successful:
            if eff.last_successful is None:
                eff.position_before = self.last_successful
            self.last_successful = target
            eff.last_successful = target

    # --- catch-up -------------------------------------------------------------------------

    def offer_catchup(self, plans: Sequence[RoomPlan], exhausted: bool = False,
                      side: bool = False, limit: int = 0) -> None:
        """The shell planned these from ``destination_rooms`` past the cursor; send them
        in order. Events of a room already handled in this episode are not resent.
        ``side``: read beside rooms awaiting a confirmation (``limit`` rows asked)."""
        self.episode.offer(plans, exhausted, side, limit)

    def catchup_finished(self) -> Effects:
        """The shell found no rows past the cursor and everything planned was delivered:
        the position moves to the last row handled and catch-up mode ends."""
        eff = Effects()
        last_row = self.episode.finish()
        if last_row is None:
            return eff  # an event arrived while the rows were being read: look again
        self.max_done = max(self.max_done, last_row)
        self._advance(Batch((), ()), eff)
        self.episode.reset(self.last_successful)
        return eff

    def position_read(self, persisted: int | None) -> Effects:
        """The shell read the persisted position with none of this queue's writes
        pending (the wake-up sweep saw it differ from ours): another process changed
        it, and it is the truth, as at :meth:`load`. Lower (``batch audit --repair``
        lowers it past events it found lost): the rows past it may be owed, and only
        catch-up sends those, so the queue enters catch-up mode from there (an episode
        under way starts again). Higher: adopted, since the store writes ours only over
        the value we know (:attr:`Effects.position_before`)."""
        eff = Effects()
        p = -1 if persisted is None else persisted
        if p == self.last_successful:
            return eff
        lowered = p < self.last_successful
        self.last_successful = p
        if lowered:
            self._enter_catchup(eff)
        return eff

    def _enter_catchup(self, eff: Effects) -> None:
        n = self.pending.drop_volatile()
        n += sum(b.item_count for b in self.work)
        n += sum(b.item_count for b in self.isolation.batches())
        if self.current is not None:
            n += self.current.batch.item_count
        eff.dropped_for_catchup = n
        self.work.clear()
        self.isolation.clear()
        self.current = None
        eff.entered_catchup = self.episode.enter(self.last_successful)
        self.to_device_cursor = -1
        self.device_list_cursor = -1
        self.outbox_dirty = True

    # --- the runner's loop policy (times in monotonic seconds) ------------------------------

    def parks(self, wait_s: float, idle_ttl_s: float) -> bool:
        """The runner may exit instead of waiting ``wait_s``: longer than the idle TTL
        in catch-up mode with nothing in memory (the wake-up sweep brings the queue back
        when due, from the database)."""
        return (
            wait_s > idle_ttl_s and self.catching_up and not self.pending
            and self.current is None
        )

    def idle_started(self, now_s: float) -> None:
        self.loop_policy.idle_started(now_s)

    def evict_if_idle(self, now_s: float, ttl_s: float) -> bool:
        """Ask the queue, if empty and idle since ``ttl_s`` before ``now_s``, to exit."""
        return self.loop_policy.evict_if_idle(now_s, ttl_s, self.is_empty)

    def idle_ended(self) -> bool:
        """The runner's idle wait is over: True if it exits (evicted, still empty)."""
        return self.loop_policy.idle_ended(self.is_empty)

    # --- operator actions ------------------------------------------------------------------

    def clear_backoff(self) -> bool:
        """The destination was reported up (or an operator reset it): send now. A
        short-retry phase keeps its count (a destination that stays down still reaches
        the persisted backoff)."""
        woken = self.short_retry.wake()
        paused = self.rate_limit.clear() or woken
        was = self.backoff.backing_off
        self.backoff = RESET
        self.return_seen = False
        return was or paused

    def stop(self) -> None:
        self.stopped = True
        self.sm.to(DestinationState.STOPPED)

    # --- status ----------------------------------------------------------------------------

    def _held(self) -> tuple[Batch, ...]:
        cur = (self.current.batch,) if self.current is not None else ()
        return (*self.work, *self.isolation.batches(), *cur)

    @property
    def pending_pdus(self) -> int:
        return self.pending.pdu_count + sum(len(b.pdus) for b in self._held())

    @property
    def pending_edus(self) -> int:
        return self.pending.edu_count + sum(len(b.edus) for b in self._held())

    def is_empty(self) -> bool:
        return (
            self.current is None
            and not self.work
            and not self.pending
            and not self.isolation
            and not self.episode.plans
            and not self.episode.active
            and not self.outbox_dirty
        )


def _unanswered(result: SendResult) -> bool:
    """A failure the short-retry phase retries: no answer (refused or broken connection,
    timeout) or a 5xx, as Synapse's sender retries inside the request; not a 429 (the
    rate limit's) nor a refusal."""
    if result.outcome is not Outcome.TRANSIENT:
        return False
    return result.status is None or result.status >= 500


def _always(_core: DestinationCore, _now_ms: int) -> bool:
    return True


@dataclass(frozen=True, slots=True)
class Rule:
    """One row of :data:`NEXT_STEP`: a name (the docs list them), a condition, and the
    step it gives (``None``: nothing to do after all, the next row decides)."""

    name: str
    when: Callable[[DestinationCore, int], bool]
    then: Callable[[DestinationCore, int], Step | None]


NEXT_STEP: tuple[Rule, ...] = (
    Rule("stopped: nothing more", lambda c, _now: c.stopped, lambda _c, _now: Idle()),
    Rule("backing off with something to send, down under an hour: ask if it is back",
         DestinationCore._return_probe_due, DestinationCore._probe_return),
    Rule("paused (backoff, 429, short retry): wait until it ends (or the next probe)",
         DestinationCore._paused, DestinationCore._wait_out_pause),
    Rule("a transaction in flight: send it again, same id",
         lambda c, _now: c.current is not None,
         lambda c, _now: c._send(c.current) if c.current is not None else None),
    Rule("outbox rows may be waiting (to-device, device lists): read them",
         DestinationCore._outbox_to_read, DestinationCore._read_outbox),
    Rule("catching up with no rooms planned: read destination_rooms",
         DestinationCore._catchup_rows_to_read, DestinationCore._read_catchup_rows),
    Rule("anything to send (work, catch-up page, quarantine due, pending): send it",
         _always, DestinationCore._send_next_batch),
    Rule("catching up, the next page's room awaits its confirmation: read the other rooms",
         DestinationCore._side_read_due, DestinationCore._read_beside),
    Rule("only quarantined items: wait for the next retry",
         _always, DestinationCore._wait_for_quarantine),
    Rule("only PDUs of rooms awaiting the receiver's confirmation: wait for one",
         DestinationCore._held_back, DestinationCore._await_confirmation),
    Rule("nothing: idle", _always, DestinationCore._go_idle),
)
"""What a queue does next, in order: the first row whose condition holds and that
gives a step decides. docs/queue-engine.md lists the rows (checked by
tests/queue/test_core_statemachine.py).

**Send at once; batch only behind a transaction in flight**, as Synapse's
``PerDestinationQueue``: a destination has at most one transaction in flight (row 3), a
new item wakes its queue at once, and a queue with nothing in flight sends what it holds
now, however little (row 6). What arrives while a transaction is in flight waits for its
answer, and the next transaction takes all of it (within the PDU, EDU and byte limits).
At a low rate every PDU goes alone and at once; at a high rate the round trip sets the
transactions' size, so batching grows with the load by itself. The one other wait is
upstream, in the shell: while the fan-out is behind, a part-filled batch waits for its
hand-overs, at most ``queue.coalesce_hold_s`` (:mod:`~federation_sender.queue.coalesce`).
Nothing holds a queue for a time of its own (the former steady-stream hold,
``queue.busy_txn_interval_s``, held a part-filled transaction up to 2 s: a chat message
waited for a batch that was not coming)."""
