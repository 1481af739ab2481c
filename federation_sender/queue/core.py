"""The sans-I/O core of one destination queue.

The asyncio shell (:mod:`federation_sender.queue.runner`) repeatedly asks
:meth:`DestinationCore.next_step` what to do, performs it (sleep, read the database,
send a transaction) and feeds the outcome back. Everything that decides anything lives
here, so it is tested synchronously, including by a Hypothesis state machine.

Invariants:

* At most one transaction is in flight (``current``); it is frozen, with its txn id,
  from the moment it is built until a 200, a split, or a fall back to catch-up. Retries
  resend identical content under the identical id.
* ``last_successful_stream_ordering`` only advances to a position below every PDU
  still held in memory (pending, queued halves, quarantine), so a crash never skips a
  PDU that was not delivered: catch-up resumes from there.
* In catch-up mode no PDU is held in memory; the intake has already recorded it in
  ``destination_rooms``, where catch-up finds it (``catchup_last_skipped`` makes sure a
  PDU arriving while catch-up reads the table is not missed).
* A catch-up episode reads ``destination_rooms`` past a keyset cursor and replays gaps
  from the episode's base position; the position moves to the last row handled only
  when the episode ends (a restart mid-episode repeats it: duplicates, never losses).
* A refusal (400, or 500 with a response) of a transaction of several items splits it;
  a single refused item is quarantined and retried after others succeed, and dropped
  after ``max_item_failures`` refusals with successes in between. Without a success
  since, an empty probe transaction asks whether the destination is up; a refused probe,
  or a run of refusals with no success, means the destination, not an item, is broken:
  that is a normal failure (backoff).
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field

from federation_sender.model import EventRow
from federation_sender.queue.backoff import RESET, BackoffPolicy, BackoffState
from federation_sender.queue.batching import Batch, Limits, take_batch, take_edus
from federation_sender.queue.catchup import RoomPlan, pack_next, pdu_item
from federation_sender.queue.destination import DestinationState, DestinationStateMachine
from federation_sender.queue.items import (
    EduItem,
    EduKind,
    JsonDict,
    PduItem,
    PendingItems,
    make_edu,
)
from federation_sender.transport.result import Outcome, SendResult

REFUSAL_STATUSES = frozenset({400, 500})
MAX_REFUSALS_WITHOUT_SUCCESS = 16
SERVER_ERROR_FACTOR = 3
"""Enough to bisect 150 items twice over; beyond it the destination is the problem."""


@dataclass(frozen=True, slots=True)
class Idle:
    pass


@dataclass(frozen=True, slots=True)
class Wait:
    until_ms: int


@dataclass(frozen=True, slots=True)
class NeedCatchup:
    after: int
    """The episode's base position: gaps are replayed from here."""
    cursor: tuple[int, str | None]
    """Read ``destination_rooms`` rows past this (stream_ordering, room_id) keyset."""
    exhausted: bool = False
    """The last read returned fewer rows than asked: no need to read again."""


@dataclass(frozen=True, slots=True)
class NeedOutbox:
    to_device_after: int
    device_lists_after: int


@dataclass(frozen=True, slots=True)
class FrozenTxn:
    txn_id: str
    batch: Batch
    attempts: int = 0


@dataclass(frozen=True, slots=True)
class Send:
    txn: FrozenTxn


Step = Idle | Wait | NeedCatchup | NeedOutbox | Send


@dataclass(slots=True)
class Effects:
    """What the shell must persist and report after a result."""

    backoff: BackoffState | None = None
    last_successful: int | None = None
    to_device_sent: list[int] = field(default_factory=list)
    device_lists_sent: list[tuple[int, str, str]] = field(default_factory=list)
    prune: list[tuple[str, int]] = field(default_factory=list)
    dropped: list[tuple[PduItem | EduItem, str]] = field(default_factory=list)
    entered_catchup: bool = False
    dropped_for_catchup: int = 0


def _outbox_keys(items: Iterable[PduItem | EduItem], eff: Effects) -> None:
    for e in items:
        if isinstance(e, EduItem) and e.outbox_key is not None:
            if e.kind is EduKind.TO_DEVICE:
                eff.to_device_sent.append(e.outbox_key[0])
            else:
                eff.device_lists_sent.append(e.outbox_key)


def _failure_key(item: PduItem | EduItem) -> str | int:
    """PDUs by event id (catch-up re-reads them as new objects), EDUs by identity."""
    return item.event_id if isinstance(item, PduItem) else item.uid


class DestinationCore:
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
    ) -> None:
        self.destination = destination
        self.parse_pdu = parse_pdu
        self.policy = policy
        self.limits = limits
        self.rng = rng
        self._next_txn_id = next_txn_id
        self.max_item_failures = max_item_failures
        self.sm = DestinationStateMachine(on_state_change)
        self.pending = PendingItems()
        self.backoff: BackoffState = RESET
        self.catching_up = catching_up
        """Catch-up *mode*: set for queues that may have missed events (at startup, after
        a long backoff, after a crash of their runner)."""
        self.last_successful = -1
        self.catchup_last_skipped = -1
        self.max_done = -1
        self._catchup_recheck = False
        self._catchup_exhausted = False
        self.current: FrozenTxn | None = None
        self.work: deque[Batch] = deque()
        self.catchup_plans: deque[RoomPlan] = deque()
        self.catchup_cursor: tuple[int, str | None] = (-1, None)
        self.catchup_room_floor: dict[str, int] = {}
        self.rooms_per_txn = initial_rooms_per_txn
        self.max_rooms_per_txn = max_rooms_per_txn
        self.fast_answer_s = fast_answer_s
        self.quarantine: deque[Batch] = deque()
        self.item_failures: dict[str | int, tuple[int, int]] = {}
        """failure key -> (refusals of the item alone, ``successes`` at the first one)"""
        self.successes = 0
        self._retry_quarantine = False
        self.refusals_without_success = 0
        self.to_device_cursor = -1
        self.device_list_cursor = -1
        self.outbox_dirty = True
        self.last_error: str | None = None
        self.stopped = False

    # --- loading and intake ---------------------------------------------------------

    def load(self, backoff: BackoffState, last_successful: int | None) -> Effects:
        """Apply the persisted state. A backoff past the catch-up threshold puts the
        queue in catch-up mode (dropping what was queued before loading)."""
        eff = Effects()
        self.backoff = backoff
        self.last_successful = -1 if last_successful is None else last_successful
        self._reset_episode()
        if self.policy.should_catch_up(backoff):
            self._enter_catchup(eff)
        return eff

    def add_pdu(self, item: PduItem) -> None:
        if self.catching_up:
            self.catchup_last_skipped = max(self.catchup_last_skipped, item.stream_ordering)
        else:
            self.pending.add_pdu(item)

    def add_pdus(self, items: Sequence[PduItem]) -> None:
        """Like :meth:`add_pdu` for each item; ``items`` are in stream order."""
        if not items:
            return
        if self.catching_up:
            self.catchup_last_skipped = max(self.catchup_last_skipped, items[-1].stream_ordering)
        else:
            self.pending.add_pdus(items)

    def add_edu(self, edu_type: str, content: JsonDict, key: Hashable | None = None) -> None:
        self.pending.add_edu(edu_type, content, key)

    def add_presence(self, states: Iterable[JsonDict]) -> None:
        self.pending.add_presence(states)

    def add_receipt(self, room_id: str, receipt_type: str, user_id: str, data: JsonDict) -> None:
        self.pending.add_receipt(room_id, receipt_type, user_id, data)

    def poke_outbox(self) -> None:
        self.outbox_dirty = True

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
        if exhausted:
            self.outbox_dirty = False

    # --- the decision -----------------------------------------------------------------

    def _has_sendable(self) -> bool:
        return (
            bool(self.work)
            or bool(self.pending)
            or bool(self.quarantine)
            or bool(self.catchup_plans)
        )

    def next_step(self, now_ms: int) -> Step:
        if self.stopped:
            return Idle()
        if self.backoff.active_at(now_ms):
            retry_at = self.backoff.retry_at_ms
            assert retry_at is not None
            self.sm.to(DestinationState.BACKING_OFF)
            return Wait(retry_at)
        if self.current is not None:
            self._to_sending()
            return Send(self.current)
        outbox_low = (
            len(self.pending.to_device) + len(self.pending.device_lists) < self.limits.max_edus
        )
        if self.outbox_dirty and outbox_low:
            self._to_sending()
            return NeedOutbox(self.to_device_cursor, self.device_list_cursor)
        if not self.work and self.catching_up and not self.catchup_plans:
            self.sm.to(DestinationState.CATCHING_UP)
            return NeedCatchup(
                self.last_successful, self.catchup_cursor, self._catchup_exhausted
            )
        batch: Batch | None = None
        if not self.work and self.catchup_plans:
            self.work.append(
                pack_next(self.catchup_plans, self.rooms_per_txn, self.limits, self.parse_pdu)
            )
        if self.work:
            batch = self.work.popleft()
            if batch.catchup and len(batch.edus) == 0:
                batch = self._fill_edus(batch)
        elif self.quarantine and (self._retry_quarantine or not self.pending):
            batch = self.quarantine.popleft()
            self._retry_quarantine = False
        elif self.pending:
            batch = take_batch(self.pending, self.limits)
        elif self.quarantine:
            batch = self.quarantine.popleft()
        if batch is None or not batch:
            if batch is not None and batch.catchup_position is not None:
                # An empty catch-up batch still carries a position to advance.
                self.current = FrozenTxn(self._next_txn_id(), batch)
                self._to_sending()
                return Send(self.current)
            self.sm.to(DestinationState.IDLE)
            return Idle()
        self.current = FrozenTxn(self._next_txn_id(), batch)
        self._to_sending()
        return Send(self.current)

    def _to_sending(self) -> None:
        self.sm.to(
            DestinationState.CATCHING_UP if self.catching_up else DestinationState.SENDING
        )

    def _fill_edus(self, batch: Batch) -> Batch:
        used = batch.size_bytes
        limits = Limits(
            max_pdus=self.limits.max_pdus,
            max_edus=self.limits.max_edus,
            max_bytes=max(0, self.limits.max_bytes - used),
            device_list_reserve=self.limits.device_list_reserve,
        )
        edus = take_edus(self.pending, limits)
        if not edus:
            return batch
        return Batch(
            batch.pdus, tuple(edus), True, batch.catchup_position, batch.catchup_prune
        )

    # --- catch-up -------------------------------------------------------------------------

    def offer_catchup(self, plans: Sequence[RoomPlan], exhausted: bool = False) -> None:
        """The shell planned these from ``destination_rooms`` past the cursor; send them
        in order. Events of a room already handled in this episode are not resent."""
        for plan in plans:
            floor = self.catchup_room_floor.get(plan.room_id)
            if floor is not None:
                plan = RoomPlan(
                    plan.room_id,
                    plan.row_stream_ordering,
                    tuple(e for e in plan.events if e.stream_ordering > floor),
                    plan.prune,
                    plan.mode,
                )
            self.catchup_room_floor[plan.room_id] = plan.row_stream_ordering
            # Plans arrive in the database's keyset order (its collation, not Python's).
            self.catchup_cursor = (plan.row_stream_ordering, plan.room_id)
            self.catchup_plans.append(plan)
        self._catchup_recheck = False
        self._catchup_exhausted = exhausted

    def catchup_finished(self) -> Effects:
        """The shell found no rows past the cursor and everything planned was delivered:
        the position moves to the last row handled and catch-up mode ends."""
        eff = Effects()
        if self.catchup_last_skipped > self.catchup_cursor[0] and not self._catchup_recheck:
            # An event arrived while the rows were being read: look once more.
            self._catchup_recheck = True
            self._catchup_exhausted = False
            return eff
        self._catchup_recheck = False
        self.catching_up = False
        self.catchup_last_skipped = -1
        self.max_done = max(self.max_done, self.catchup_cursor[0])
        self._advance(Batch((), ()), eff)
        self._reset_episode()
        return eff

    def _reset_episode(self) -> None:
        self._catchup_exhausted = False
        self.catchup_cursor = (self.last_successful, None)
        self.catchup_room_floor = {}

    def _enter_catchup(self, eff: Effects) -> None:
        eff.entered_catchup = not self.catching_up
        n = self.pending.drop_volatile()
        n += sum(b.item_count for b in self.work) + sum(b.item_count for b in self.quarantine)
        if self.current is not None:
            n += self.current.batch.item_count
        eff.dropped_for_catchup = n
        self.work.clear()
        self.catchup_plans.clear()
        self.quarantine.clear()
        self.item_failures.clear()
        self.current = None
        self.catching_up = True
        self._reset_episode()
        self.to_device_cursor = -1
        self.device_list_cursor = -1
        self.outbox_dirty = True

    # --- results ---------------------------------------------------------------------------

    def _min_held_stream_ordering(self) -> int | None:
        m = self.pending.min_stream_ordering()
        if not self.work and not self.quarantine:
            return m
        sos = [p.stream_ordering for b in (*self.work, *self.quarantine) for p in b.pdus]
        if m is not None:
            sos.append(m)
        return min(sos, default=None)

    def on_result(self, txn: FrozenTxn, result: SendResult, now_ms: int) -> Effects:
        if self.current is not txn:
            raise RuntimeError("result for a transaction that is not in flight")
        eff = Effects()
        batch = txn.batch
        if result.outcome is Outcome.SUCCESS:
            self.current = None
            self.successes += 1
            self.last_error = None
            self.refusals_without_success = 0
            self._retry_quarantine = bool(self.quarantine)
            if self.backoff != RESET:
                self.backoff = RESET
                eff.backoff = RESET
            if self.item_failures:
                for p in batch.pdus:
                    self.item_failures.pop(p.event_id, None)
                for e in batch.edus:
                    self.item_failures.pop(e.uid, None)
            _outbox_keys(batch.edus, eff)
            eff.prune.extend(batch.catchup_prune)
            if batch.catchup:
                if result.duration_s <= self.fast_answer_s:
                    self.rooms_per_txn = min(self.max_rooms_per_txn, self.rooms_per_txn * 2)
                else:
                    self.rooms_per_txn = 1
            if not self.catching_up:
                # Catch-up moves the position only when the episode ends: until then
                # rooms not yet handled may hold missed events below any row handled.
                self._advance(batch, eff)
            return eff

        self.last_error = result.error or result.outcome.value
        if result.outcome is Outcome.TOO_LARGE:
            self.current = None
            if batch.item_count >= 2:
                self.work.extendleft(reversed(batch.split()))
            else:
                self._drop(batch, "too_large", eff)
            return eff

        if (
            result.status in REFUSAL_STATUSES
            and self.refusals_without_success < MAX_REFUSALS_WITHOUT_SUCCESS
            and not batch.probe
        ):
            self.refusals_without_success += 1
            self.current = None
            if batch.item_count >= 2:
                self.work.extendleft(reversed(batch.split()))
                return eff
            if self._isolate(batch, eff, result.status):
                return eff
            self.current = txn

        # The destination is down (or refuses everything): back off, keep the frozen
        # transaction for an identical retry.
        self.refusals_without_success = 0
        self.current = FrozenTxn(txn.txn_id, batch, txn.attempts + 1)
        self.backoff = self.policy.on_failure(
            self.backoff, now_ms, self.rng, result.retry_after_s
        )
        eff.backoff = self.backoff
        if self.policy.should_catch_up(self.backoff):
            self._enter_catchup(eff)
        return eff

    def _isolate(self, batch: Batch, eff: Effects, status: int | None) -> bool:
        """A single item was refused alone. True if handled; False means the refusals
        must be blamed on the destination instead (a normal failure).

        A 400 names the transaction as bad; a 500 may just as well be a flaky server
        that fails at random, so an item refused with 500 must be refused alone
        ``SERVER_ERROR_FACTOR`` times as often before it is dropped (at a 20 % random
        error rate: 0.2**9 instead of 0.2**3 per quarantined item)."""
        limit = self.max_item_failures
        if status != 400:
            limit *= SERVER_ERROR_FACTOR
        items: list[PduItem | EduItem] = [*batch.pdus, *batch.edus]
        if not items:
            return False
        key = _failure_key(items[0])
        n, since = self.item_failures.get(key, (0, self.successes))
        n += 1
        self.item_failures[key] = (n, since)
        if n < limit:
            self.quarantine.append(batch)
            return True
        if self.successes > since:
            # Refused alone, again and again, while other transactions got through:
            # the item is the problem, not the destination.
            self._drop(batch, "refused", eff)
            return True
        if n == limit:
            # Nothing else got through meanwhile: ask the destination whether it is up
            # with an empty transaction before blaming the item.
            self.quarantine.appendleft(batch)
            self.work.appendleft(Batch((), (), probe=True))
            return True
        return False

    def _drop(self, batch: Batch, reason: str, eff: Effects) -> None:
        items: list[PduItem | EduItem] = [*batch.pdus, *batch.edus]
        for item in items:
            eff.dropped.append((item, reason))
            self.item_failures.pop(_failure_key(item), None)
        # A dropped outbox row is marked sent so it cannot poison the queue again.
        _outbox_keys(batch.edus, eff)
        eff.prune.extend(batch.catchup_prune)
        if not self.catching_up:
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
            self.last_successful = target
            eff.last_successful = target

    # --- operator actions ------------------------------------------------------------------

    def clear_backoff(self) -> bool:
        was = self.backoff.backing_off
        self.backoff = RESET
        return was

    def stop(self) -> None:
        self.stopped = True
        self.sm.to(DestinationState.STOPPED)

    # --- status ----------------------------------------------------------------------------

    @property
    def pending_pdus(self) -> int:
        held = sum(len(b.pdus) for b in (*self.work, *self.quarantine))
        cur = len(self.current.batch.pdus) if self.current else 0
        return self.pending.pdu_count + held + cur

    @property
    def pending_edus(self) -> int:
        held = sum(len(b.edus) for b in (*self.work, *self.quarantine))
        cur = len(self.current.batch.edus) if self.current else 0
        return self.pending.edu_count + held + cur

    def is_empty(self) -> bool:
        return (
            self.current is None
            and not self._has_sendable()
            and not self.catching_up
            and not self.outbox_dirty
        )
