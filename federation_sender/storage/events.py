"""Reading ``events``, ``event_forward_extremities`` and ``partial_state_rooms``.

The queue engine only reads these tables (the main process writes them). Event JSON is
returned as text; callers parse it once and share the parsed PDU between destinations.
The reads are the shared ones of :mod:`.event_reads`, over the native columns.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncConnection

from federation_sender.model import EventRow
from federation_sender.storage.event_reads import EventQueries, EventSource
from federation_sender.storage.schema import (
    event_forward_extremities,
    events,
    partial_state_rooms,
)

_COLS = (
    events.c.stream_ordering,
    events.c.event_id,
    events.c.room_id,
    events.c.type,
    events.c.state_key,
    events.c.sender,
    events.c.outlier,
    events.c.rejected,
    events.c.json,
)


def _row(r: Sequence[object]) -> EventRow:
    return EventRow(
        stream_ordering=int(r[0]),  # type: ignore[call-overload]
        event_id=str(r[1]),
        room_id=str(r[2]),
        type=str(r[3]),
        state_key=None if r[4] is None else str(r[4]),
        sender=str(r[5]),
        outlier=bool(r[6]),
        rejected=bool(r[7]),
        json=str(r[8]),
    )


QUERIES = EventQueries(EventSource(
    events=events,
    extremities=event_forward_extremities,
    partial_state=partial_state_rooms,
    cols=_COLS,
    from_=events,
    to_row=_row,
    received_ts=events.c.origin_server_ts,  # the native schema keeps no reception time
))

max_stream_ordering = QUERIES.max_stream_ordering
stream_orderings_after = QUERIES.stream_orderings_after
events_after = QUERIES.events_after
events_at = QUERIES.events_at
room_events_between = QUERIES.room_events_between
forward_extremities = QUERIES.forward_extremities
partial_state = QUERIES.partial_state


async def rooms_with_events(conn: AsyncConnection, room_ids: Collection[str]) -> set[str]:
    """Rooms that still have at least one event (the others were purged)."""
    if not room_ids:
        return set()
    res = await conn.execute(
        select(events.c.room_id).where(events.c.room_id.in_(list(room_ids))).distinct()
    )
    return {str(r[0]) for r in res}
