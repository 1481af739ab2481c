"""Catch-up mode and the catch-up episode in progress: a pure object of one queue.

A queue is in catch-up *mode* (``active``) when it may have missed events: at startup,
after a long backoff, after a crash of its runner. An *episode* starts at the persisted
position P and reads ``destination_rooms`` past a keyset cursor (stream ordering, room);
the rooms' plans are packed into transactions adaptively (``rooms_per_txn`` doubles
after a fast answer, back to one room after a slow one). The position moves to the
last row handled only when the episode ends: a room whose row is newer than the cursor
may still hold missed events older than rows already handled.

While in catch-up mode no PDU is held in memory; ``last_skipped`` remembers the newest
PDU that arrived meanwhile, so an event recorded while the rows were being read is not
missed (one more read before the episode ends).

A room's long gap goes a page at a time, each page confirmed processed by the receiver
before the next (pacing), and the cursor stays before the room's row until its gap is
done. So that this holds back no other room, while the next page's room awaits its
confirmation the queue reads *beside* it (:meth:`side_read`): the rows past the side
cursor of every room but those waiting, planned as usual (a room's floor then records
what was handled, so the main read, when it gets there, sends nothing twice). Side
reads leave the cursor, the end-of-episode rule and the position alone; one is due
after a page leaves rows unread behind it, after an event arrives, and while the last
one filled its limit.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import replace

from federation_sender.model import EventRow
from federation_sender.queue.core.batching import Batch, Limits
from federation_sender.queue.core.catchup import RoomPlan, pack_next
from federation_sender.queue.core.items import PduItem


class CatchupEpisode:
    __slots__ = (
        "_exhausted",
        "_recheck",
        "active",
        "cursor",
        "fast_answer_s",
        "last_skipped",
        "max_rooms_per_txn",
        "plans",
        "room_floor",
        "rooms_per_txn",
        "side_cursor",
        "side_due",
    )

    def __init__(
        self,
        active: bool,
        initial_rooms_per_txn: int = 8,
        max_rooms_per_txn: int = 50,
        fast_answer_s: float = 1.0,
    ) -> None:
        self.active = active
        self.last_skipped = -1
        self.plans: list[RoomPlan] = []
        self.cursor: tuple[int, str | None] = (-1, None)
        self.room_floor: dict[str, int] = {}
        self.rooms_per_txn = initial_rooms_per_txn
        self.max_rooms_per_txn = max_rooms_per_txn
        self.fast_answer_s = fast_answer_s
        self._recheck = False
        self._exhausted = False
        self.side_cursor: tuple[int, str | None] = self.cursor
        self.side_due = False

    @property
    def exhausted(self) -> bool:
        """The last read returned fewer rows than asked: no need to read again."""
        return self._exhausted

    def reset(self, base: int) -> None:
        """A new episode starts at ``base`` (the persisted position)."""
        self._exhausted = False
        self.cursor = (base, None)
        self.room_floor = {}
        self.side_cursor = self.cursor
        self.side_due = False

    def enter(self, base: int) -> bool:
        """Enter catch-up mode, dropping the plans in progress; True if it was off."""
        was = self.active
        self.active = True
        self.plans.clear()
        self.reset(base)
        return not was

    def skipped(self, stream_ordering: int) -> None:
        """A PDU arrived in catch-up mode: the fan-out recorded it in the table."""
        if stream_ordering > self.last_skipped:
            self.last_skipped = stream_ordering
        self.side_due = True

    def side_read(self) -> tuple[int, str | None]:
        """A read beside the waiting rooms starts: from where, past the main cursor."""
        self.side_due = False
        if _key(self.side_cursor) < _key(self.cursor):
            self.side_cursor = self.cursor
        return self.side_cursor

    def offer(self, plans: Sequence[RoomPlan], exhausted: bool, side: bool = False,
              limit: int = 0) -> None:
        """Plans read past the cursor, in the database's keyset order. Events of a room
        already handled in this episode are not resent. A page of a long gap
        (``RoomPlan.more``) leaves the cursor before its room and the episode not
        exhausted: the next read continues the room past ``read_upto``. ``side``: a
        read beside waiting rooms (``limit``: the rows it asked for), which moves the
        side cursor instead."""
        if side:
            self._offer_side(plans, limit)
            return
        for plan in plans:
            plan = self._unsent(plan)
            self.plans.append(plan)
            if plan.cut:
                exhausted = False
            if plan.more:
                # A page of a long gap (always the last plan of a read): the cursor
                # stays before the room's row, so the next read takes the room again,
                # from where this page ended.
                self.room_floor[plan.room_id] = plan.read_upto
                break
            self.room_floor[plan.room_id] = plan.row_stream_ordering
            # Plans arrive in the database's keyset order (its collation, not Python's).
            self.cursor = (plan.row_stream_ordering, plan.room_id)
        self._recheck = False
        self._exhausted = exhausted
        if any(p.more for p in plans):
            self.side_due = True  # rows past the paged room are still to be read

    def _unsent(self, plan: RoomPlan) -> RoomPlan:
        """``plan`` without the events of its room this episode already handled."""
        floor = self.room_floor.get(plan.room_id)
        if floor is None:
            return plan
        return replace(plan, events=tuple(e for e in plan.events if e.stream_ordering > floor))

    def _offer_side(self, plans: Sequence[RoomPlan], limit: int) -> None:
        for plan in plans:
            plan = self._unsent(plan)
            self.plans.append(plan)
            if plan.more:
                # Another long gap: its next page is read from its floor, and the side
                # cursor stays before its row (the next side read skips it while it
                # waits, and takes it again once it does not).
                self.room_floor[plan.room_id] = plan.read_upto
                self.side_due = True
                return
            self.room_floor[plan.room_id] = max(self.room_floor.get(plan.room_id, -1),
                                                plan.row_stream_ordering)
            self.side_cursor = (plan.row_stream_ordering, plan.room_id)
        if limit and len(plans) >= limit:
            self.side_due = True  # a full read: more rows may follow

    def next_batch(self, limits: Limits, parse: Callable[[EventRow], PduItem],
                   held: Collection[str] = ()) -> Batch:
        """The next transaction of the plans, stopping before a ``held`` room."""
        return pack_next(self.plans, self.rooms_per_txn, limits, parse, held)

    def answered(self, duration_s: float) -> None:
        """A catch-up transaction got its 200 after ``duration_s``: adapt the packing."""
        if duration_s <= self.fast_answer_s:
            self.rooms_per_txn = min(self.max_rooms_per_txn, self.rooms_per_txn * 2)
        else:
            self.rooms_per_txn = 1

    def finish(self) -> int | None:
        """No rows past the cursor and everything planned delivered. Returns the
        stream ordering of the last row handled when the episode (and catch-up mode)
        ends, None when an event arrived while reading: look once more first."""
        if self.last_skipped > self.cursor[0] and not self._recheck:
            self._recheck = True
            self._exhausted = False
            return None
        self._recheck = False
        self.active = False
        self.last_skipped = -1
        return self.cursor[0]


def _key(cursor: tuple[int, str | None]) -> tuple[int, int, str]:
    """A keyset cursor's place: (S, None) is past every row at S (the read without a
    room asks for rows past S), so after (S, any room)."""
    so, room = cursor
    return (so, 1, "") if room is None else (so, 0, room)
