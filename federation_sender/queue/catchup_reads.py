"""Catch-up's reads: the inputs of :mod:`federation_sender.queue.core.catchup`'s pure plans,
loaded through the storage boundary inside one transaction of the queue's store.

:func:`plan_rows` takes the next ``destination_rooms`` rows past the episode's cursor,
reads each room's gap one page at a time (from the episode's base, or from where the
room's last page ended), finds the first room whose gap is longer than a page (paged
through: the read stops at it) and the rooms whose gap is too long to replay (their
extremities instead), asks the backend which candidates the destination may not see,
and returns one :class:`RoomPlan` per row read.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import replace

from federation_sender.model import EventRow, MembershipRow
from federation_sender.queue.core.catchup import (
    GAP_PAGE_EVENTS,
    RoomInput,
    RoomPlan,
    is_sendable,
    plan_room,
)
from federation_sender.storage.protocols import Tx
from federation_sender.visibility import Verdict, decide

log = logging.getLogger(__name__)

Rows = list[tuple[str, int]]
"""``destination_rooms`` rows: (room, stream ordering)."""


async def plan_rows(
    tx: Tx,
    *,
    destination: str,
    server_name: str,
    after: int,
    cursor: tuple[int, str | None],
    rooms_limit: int,
    max_gap_events: int,
    floors: Mapping[str, int] | None = None,
    page_events: int = GAP_PAGE_EVENTS,
) -> list[RoomPlan]:
    """Plans for the rows past ``cursor``. A room's gap is read from ``after`` (the
    episode's base), or from its floor (``floors``: the last event read of a room this
    episode already paged through), one page (``page_events``) at a time: a gap longer
    than a page and at most ``max_gap_events`` long ends the read with a ``more``
    plan of its first page holding something to send (``queue/core/catchup.py``)."""
    rows = await tx.catchup.catchup_rows(destination, cursor[0], rooms_limit, cursor[1])
    if not rows:
        return []
    page = max(1, min(page_events, max_gap_events))
    fresh, missed = await _read_gaps(tx, rows, after, floors or {}, page)
    rows, long_gap, paged = await _long_gaps(tx, rows, missed, fresh, after, page,
                                             max_gap_events)
    room_ids = [r for r, _ in rows]
    whole = [r for r in room_ids if paged is None or r != paged[0]]
    # The common case (short gaps) needs neither partial-state flags nor extremities,
    # and finds the row's own event at the end of the gap.
    partial = await tx.events.partial_state(long_gap) if long_gap else set()
    extremities = await tx.events.forward_extremities([r for r in long_gap if r not in partial])
    history = await tx.catchup.server_membership_history(destination, room_ids)
    row_events = await _row_events(tx, rows, missed, long_gap, whole)
    withheld = await _withheld(
        tx, destination, server_name,
        [e for r in whole if r not in long_gap for e in missed.get(r, ())
         if is_sendable(e, server_name)],
        [e for evs in extremities.values() for e in evs],
        [e for so, e in row_events.items() if paged is None or so != paged[1]],
    )  # fmt: skip
    plans = [
        plan_room(
            RoomInput(
                room_id=room,
                row_stream_ordering=so,
                missed=missed.get(room, []) if room not in long_gap else [],
                extremities=extremities.get(room, []),
                partial_state=room in partial,
                history=history.get(room, []),
                row_event=row_events.get(so),
                withheld=withheld,
            ),
            destination,
            server_name,
            max_gap_events if room not in long_gap else -1,
        )
        for room, so in rows
        if room in whole
    ]
    if paged is not None:
        last = await _page(
            tx, destination=destination, server_name=server_name, room=paged[0],
            row_so=paged[1], first=missed[paged[0]], page=page,
            history=history.get(paged[0], []),
        )  # fmt: skip
        plans.append(replace(last, cut=True))
    return plans


async def _read_gaps(
    tx: Tx, rows: Rows, after: int, floors: Mapping[str, int], page: int
) -> tuple[list[str], dict[str, list[EventRow]]]:
    """The rooms read from the episode's base (``fresh``) and each room's gap up to its
    row, at most one page and one event more (``missed``)."""
    row_so = dict(rows)
    upto = max(row_so.values())
    # A floor inside a row's gap: the room was paged through (or handled) this episode.
    fresh = [r for r, so in rows if not after < floors.get(r, after) < so]
    missed = await tx.events.room_events_between(fresh, after, upto, page + 1)
    for room, so in rows:
        if room not in fresh:
            missed.update(await tx.events.room_events_between([room], floors[room], so,
                                                               page + 1))
    for room, evs in missed.items():
        missed[room] = [e for e in evs if e.stream_ordering <= row_so[room]]
    return fresh, missed


async def _long_gaps(
    tx: Tx, rows: Rows, missed: Mapping[str, Sequence[EventRow]], fresh: Sequence[str],
    after: int, page: int, max_gap_events: int,
) -> tuple[Rows, list[str], tuple[str, int] | None]:
    """The rows this read plans (those up to the first paged room), the rooms whose gap
    is longer than ``max_gap_events`` (counted from the episode's base: extremities, as
    before paging), and the first room whose gap is longer than a page (paged through;
    the rooms after it are read again after its gap)."""
    long_gap: list[str] = []
    for i, (room, so) in enumerate(rows):
        if len(missed.get(room, ())) <= page:
            continue
        if room in fresh and await tx.events.room_gap_longer_than(
                room, after, so, max_gap_events):
            long_gap.append(room)
            continue
        return rows[: i + 1], long_gap, (room, so)
    return rows, long_gap, None


async def _row_events(
    tx: Tx, rows: Rows, missed: Mapping[str, Sequence[EventRow]], long_gap: Sequence[str],
    whole: Sequence[str],
) -> dict[int, EventRow]:
    """Each row's own event: the end of its gap when the gap was read to it, else read."""
    row_events: dict[int, EventRow] = {}
    for room, so in rows:
        gap = missed.get(room)
        if gap and gap[-1].stream_ordering == so and room not in long_gap:
            row_events[so] = gap[-1]
    lacking = [so for r, so in rows if so not in row_events and r in whole]
    if lacking:
        row_events.update(await tx.events.events_at(lacking))
    return row_events


async def _page(
    tx: Tx,
    *,
    destination: str,
    server_name: str,
    room: str,
    row_so: int,
    first: Sequence[EventRow],
    page: int,
    history: Sequence[MembershipRow],
) -> RoomPlan:
    """The next page of ``room``'s long gap with something to send (``first``: the
    page read, with one more event): pages with nothing for the destination (other
    servers' events, withheld ones) are skipped, one at a time. Ends the room (a
    complete plan) when the gap ends within a page."""
    evs = list(first)
    while True:
        more = len(evs) > page
        evs = evs[:page]
        row_event = evs[-1] if evs and evs[-1].stream_ordering == row_so else None
        if not more and row_event is None:
            row_event = (await tx.events.events_at([row_so])).get(row_so)
        withheld = await _withheld(
            tx, destination, server_name,
            [e for e in evs if is_sendable(e, server_name)],
            [row_event] if row_event is not None and not more else [],
        )  # fmt: skip
        plan = plan_room(
            RoomInput(room, row_so, evs, (), False, history,
                      None if more else row_event, withheld),
            destination, server_name, len(evs),
        )  # fmt: skip
        if not more:
            return plan
        if plan.events:
            return replace(plan, prune=False, mode="page", more=True,
                           read_upto=evs[-1].stream_ordering)
        evs = (await tx.events.room_events_between(
            [room], evs[-1].stream_ordering, row_so, page + 1)).get(room, [])


async def _withheld(
    tx: Tx, destination: str, server_name: str, *candidates: Sequence[EventRow]
) -> frozenset[str]:
    """The candidates (events catch-up may send) the destination may not see, as the
    backend knows it (none on a backend without visibility)."""
    if tx.visibility is None:
        return frozenset()
    events = {e.event_id: e for evs in candidates for e in evs}
    facts = await tx.visibility.visibility_facts(destination, server_name, list(events.values()))
    verdicts = {eid: decide(f) for eid, f in facts.items()}
    out = frozenset(eid for eid, v in verdicts.items() if v is not Verdict.SEND)
    if out:
        reasons = Counter(verdicts[eid].value for eid in out)
        log.info(
            "Catch-up to %s withholds %d events (%s)", destination, len(out),
            ", ".join(f"{r}: {n}" for r, n in sorted(reasons.items())),
        )  # fmt: skip
    return out
