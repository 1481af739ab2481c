"""Catch-up planning: which PDUs to send for the ``destination_rooms`` rows a
destination is behind on. Pure; the queue's shell loads the inputs.

For each row (room R, stream ordering S) past the destination's
``last_successful_stream_ordering`` P:

* a gap of at most ``max_gap_events`` events of R in (P, S] is replayed in order,
  oldest first: our own, non-outlier, non-rejected events that the destination was in
  the room for (or that are its own membership change, e.g. its kick). A gap longer
  than one page (``GAP_PAGE_EVENTS``) is read and sent a page at a time: the plan of
  its page says ``more``, the episode's cursor stays before R's row, and the next read
  takes R's next page from where this one ended (``room_floor``), so memory holds one
  page, not the gap. Each page goes out in one transaction, and the queue's pacing
  (:mod:`federation_sender.queue.core.pacing`) confirms the receiver processed it before
  the next (bounded by its deadline: a receiver that does not confirm is sent on
  unpaced). ``max_gap_events`` still bounds how long a gap is replayed;
* a longer gap sends R's forward extremities the destination was in the room for, so it
  can backfill the rest itself; in a partial-state room, or when no extremity
  qualifies, the event at S itself;
* a row whose room the destination is no longer in, or whose events were purged, is
  pruned once handled, so catch-up can never spin on it;
* an event the backend says the destination may not see (``RoomInput.withheld``: an
  erased sender, history visibility; :mod:`federation_sender.visibility`) is never
  sent, neither in a gap, nor as an extremity, nor as the row's own event.

Rooms are packed into transactions (``rooms_per_txn``, adapted by the queue: doubled
after a fast answer, back to one after a slow one) within the PDU and byte limits; a
transaction records the last row it completes (``catchup_position``, informational). The
queue moves ``last_successful_stream_ordering`` only when a whole catch-up episode is
done: a room not yet handled may hold missed events older than rows already handled.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, replace

from federation_sender.ids import server_of
from federation_sender.model import EventRow, MembershipRow
from federation_sender.queue.core.batching import Batch, Limits
from federation_sender.queue.core.items import JsonDict, PduItem
from federation_sender.transport.encoding import canonical_json

__all__ = [
    "GAP_PAGE_EVENTS", "PduCache", "RoomInput", "RoomPlan", "is_membership_of",
    "is_sendable", "pack_next", "pdu_item", "plan_room", "server_joined_at", "server_of",
]


GAP_PAGE_EVENTS = 50
"""Events of one room's gap read (and sent) per step: one transaction's worth (at most
50 PDUs), above pacing's 40 so that every page is confirmed before the next, and under
Synapse's 100 staged events of a room."""


def is_sendable(e: EventRow, server_name: str) -> bool:
    """Originates here (or is a join another server made through us) and is not
    out-of-band (nor rejected)."""
    return (
        not e.outlier
        and not e.rejected
        and (server_of(e.sender) == server_name or e.send_on_behalf_of is not None)
    )


def is_membership_of(e: EventRow, destination: str) -> bool:
    return e.type == "m.room.member" and e.state_key is not None and (
        server_of(e.state_key) == destination
    )


def server_joined_at(history: Iterable[MembershipRow], position: int | None) -> bool:
    """Whether any of the server's users was joined after ``position`` (None: now).

    ``history`` must be ascending by stream ordering (as the storage returns it)."""
    rows = list(history)
    if position is not None:
        cut = bisect.bisect_right([r.stream_ordering for r in rows], position)
        rows = rows[:cut]
    latest: dict[str, str] = {}
    for r in rows:
        latest[r.user_id] = r.membership
    return any(m == "join" for m in latest.values())


@dataclass(frozen=True, slots=True)
class RoomInput:
    room_id: str
    row_stream_ordering: int
    missed: Sequence[EventRow]
    """The room's events in (P, S], oldest first, at most ``max_gap_events + 1``."""
    extremities: Sequence[EventRow]
    partial_state: bool
    history: Sequence[MembershipRow]
    """The destination's membership rows in the room, oldest first."""
    row_event: EventRow | None
    """The event at S, if it still exists."""
    withheld: Collection[str] = frozenset()
    """Ids of events the destination may not see (:mod:`federation_sender.visibility`)."""


@dataclass(frozen=True, slots=True)
class RoomPlan:
    room_id: str
    row_stream_ordering: int
    events: tuple[EventRow, ...]
    prune: bool
    mode: str
    """``gap``, ``page``, ``extremities``, ``event`` or ``none``: for logs and tests."""
    more: bool = False
    """A page of a long gap: the room's events past ``read_upto`` are still to be read
    (the row is neither complete nor pruned)."""
    read_upto: int = -1
    """With ``more``: the stream ordering of the last event read (sent or not)."""
    cut: bool = False
    """The read that made this plan stopped after it (at a long gap): rows past it are
    still to be read, whatever the number of plans."""


def plan_room(inp: RoomInput, destination: str, server_name: str, max_gap_events: int) -> RoomPlan:
    def visible(e: EventRow) -> bool:
        if e.event_id in inp.withheld:
            return False
        return server_joined_at(inp.history, e.stream_ordering) or is_membership_of(
            e, destination
        )

    still_in_room = server_joined_at(inp.history, None)
    events: tuple[EventRow, ...]
    if len(inp.missed) <= max_gap_events and inp.missed:
        events = tuple(e for e in inp.missed if is_sendable(e, server_name) and visible(e))
        mode = "gap"
    else:
        events = ()
        mode = "none"
        if not inp.partial_state:
            events = tuple(e for e in inp.extremities if visible(e))
            mode = "extremities"
        row = inp.row_event
        if not events and row is not None and not row.outlier and row.event_id not in inp.withheld:
            events = (row,)
            mode = "event"
        if not events:
            mode = "none"
    prune = not still_in_room or inp.row_event is None or not events
    return RoomPlan(inp.room_id, inp.row_stream_ordering, events, prune, mode)


def pdu_item(e: EventRow) -> PduItem:
    return parsed_pdu_item(e, json.loads(e.json))


def parsed_pdu_item(e: EventRow, pdu: JsonDict) -> PduItem:
    """The queue item of ``e`` (``pdu``: its parsed JSON) with its canonical JSON, made
    once for every destination the item goes to. A PDU canonical JSON refuses (a NaN
    from old JSON) gets none: the sender then encodes it itself, and fails as it did."""
    try:
        encoded: bytes | None = canonical_json(pdu)
    except (ValueError, TypeError, RecursionError):
        encoded = None
    return PduItem(e.stream_ordering, e.event_id, e.room_id, pdu, len(e.json),
                   encoded=encoded)


class PduCache:
    """Parsed PDUs shared between destinations catching up on the same events (a
    recovery sends each event to every destination of its room). FIFO-bounded."""

    def __init__(self, max_items: int = 20_000) -> None:
        self._items: dict[str, PduItem] = {}
        self._max = max_items

    def __call__(self, e: EventRow) -> PduItem:
        item = self._items.get(e.event_id)
        if item is None or item.stream_ordering != e.stream_ordering:
            item = pdu_item(e)
            self._items[e.event_id] = item
            if len(self._items) > self._max:
                del self._items[next(iter(self._items))]
        return item


def pack_next(
    plans: list[RoomPlan],
    rooms_per_txn: int,
    limits: Limits,
    parse: Callable[[EventRow], PduItem] = pdu_item,
    held: Collection[str] = (),
) -> Batch:
    """Pop the next catch-up batch off ``plans`` (ascending by row; not empty).

    Up to ``rooms_per_txn`` rooms within the PDU and byte limits. A room with more events
    than one transaction holds sends its leading chunk alone, without advancing the
    position, and stays at the head with the rest. A page of a long gap (``more``) ends
    the batch and advances nothing. A room of ``held`` (its PDUs await the receiver's
    confirmation) ends the batch before it, unless it is the first."""
    pdus: list[PduItem] = []
    prune: list[tuple[str, int]] = []
    position: int | None = None
    size = 0
    rooms = 0
    while plans and rooms < max(1, rooms_per_txn):
        plan = plans[0]
        if rooms and plan.room_id in held:
            break
        items = [parse(e) for e in plan.events]
        if len(items) > limits.max_pdus:
            if rooms:
                break
            chunk = items[: limits.max_pdus]
            plans[0] = replace(plan, events=plan.events[limits.max_pdus :])
            return Batch(tuple(chunk), (), True, None, ())
        isize = sum(i.size for i in items)
        if rooms and (len(pdus) + len(items) > limits.max_pdus or size + isize > limits.max_bytes):
            break
        del plans[0]
        pdus.extend(items)
        size += isize
        rooms += 1
        if plan.more:
            # A page: the room's row is not done (the episode reads its next page).
            break
        position = plan.row_stream_ordering
        if plan.prune:
            prune.append((plan.room_id, plan.row_stream_ordering))
    return Batch(tuple(pdus), (), True, position, tuple(prune))
