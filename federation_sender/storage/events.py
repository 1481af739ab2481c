"""Reading ``events``, ``event_forward_extremities`` and ``partial_state_rooms``.

The queue engine only reads these tables (the main process writes them). Event JSON is
returned as text; callers parse it once and share the parsed PDU between destinations.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from sqlalchemy import Select, bindparam, func, select
from sqlalchemy.ext.asyncio import AsyncConnection

from federation_sender.model import EventRow
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


async def max_stream_ordering(conn: AsyncConnection) -> int:
    """Highest persisted stream ordering, 0 for an empty table (poll mode)."""
    v = (await conn.execute(select(func.max(events.c.stream_ordering)))).scalar()
    return int(v) if v is not None else 0


async def stream_orderings_after(conn: AsyncConnection, after: int, limit: int) -> list[int]:
    """Stream orderings of committed events above ``after``, lowest first."""
    so = events.c.stream_ordering
    res = await conn.execute(select(so).where(so > after).order_by(so).limit(limit))
    return [int(v) for v in res.scalars()]


async def events_after(
    conn: AsyncConnection, after: int, upto: int, limit: int
) -> list[EventRow]:
    """Events with ``after < stream_ordering <= upto``, oldest first, at most ``limit``."""
    res = await conn.execute(_EVENTS_AFTER, {"after": after, "upto": upto, "limit": limit})
    return [_row(r) for r in res]


# Built once: the intake reads this for every batch.
_EVENTS_AFTER = (
    select(*_COLS)
    .where(events.c.stream_ordering > bindparam("after"),
           events.c.stream_ordering <= bindparam("upto"))
    .order_by(events.c.stream_ordering)
    .limit(bindparam("limit"))
)


_EVENTS_AT = select(*_COLS).where(
    events.c.stream_ordering.in_(bindparam("sos", expanding=True))
)


async def events_at(
    conn: AsyncConnection, stream_orderings: Collection[int]
) -> dict[int, EventRow]:
    if not stream_orderings:
        return {}
    res = await conn.execute(_EVENTS_AT, {"sos": list(stream_orderings)})
    return {e.stream_ordering: e for e in map(_row, res)}


def _build_room_events_between() -> Select[Any]:
    rn = (
        func.row_number()
        .over(partition_by=events.c.room_id, order_by=events.c.stream_ordering)
        .label("rn")
    )
    inner = (
        select(*_COLS, rn)
        .where(
            events.c.room_id.in_(bindparam("rooms", expanding=True)),
            events.c.stream_ordering > bindparam("after"),
            events.c.stream_ordering <= bindparam("upto"),
        )
        .subquery()
    )
    return (
        select(*[inner.c[c.name] for c in _COLS])
        .where(inner.c.rn <= bindparam("per_room"))
        .order_by(inner.c.room_id, inner.c.stream_ordering)
    )


# Built once: hot in catch-up, and statement construction costs more than the query.
_ROOM_EVENTS_BETWEEN = _build_room_events_between()


async def room_events_between(
    conn: AsyncConnection, room_ids: Collection[str], after: int, upto: int, per_room_limit: int
) -> dict[str, list[EventRow]]:
    """For each room, its first ``per_room_limit`` events with ``after < so <= upto``,
    oldest first. One query for all rooms (a window function, on both backends)."""
    if not room_ids:
        return {}
    res = await conn.execute(
        _ROOM_EVENTS_BETWEEN,
        {"rooms": list(room_ids), "after": after, "upto": upto, "per_room": per_room_limit},
    )
    out: dict[str, list[EventRow]] = {}
    for r in res:
        e = _row(r)
        out.setdefault(e.room_id, []).append(e)
    return out


async def forward_extremities(
    conn: AsyncConnection, room_ids: Collection[str]
) -> dict[str, list[EventRow]]:
    """Each room's forward extremities that we have as events, oldest first."""
    if not room_ids:
        return {}
    res = await conn.execute(
        select(*_COLS)
        .join(
            event_forward_extremities,
            event_forward_extremities.c.event_id == events.c.event_id,
        )
        .where(event_forward_extremities.c.room_id.in_(list(room_ids)))
        .order_by(events.c.stream_ordering)
    )
    out: dict[str, list[EventRow]] = {}
    for r in res:
        e = _row(r)
        out.setdefault(e.room_id, []).append(e)
    return out


async def partial_state(conn: AsyncConnection, room_ids: Collection[str]) -> set[str]:
    if not room_ids:
        return set()
    res = await conn.execute(
        select(partial_state_rooms.c.room_id).where(
            partial_state_rooms.c.room_id.in_(list(room_ids))
        )
    )
    return {str(r[0]) for r in res}


async def rooms_with_events(conn: AsyncConnection, room_ids: Collection[str]) -> set[str]:
    """Rooms that still have at least one event (the others were purged)."""
    if not room_ids:
        return set()
    res = await conn.execute(
        select(events.c.room_id).where(events.c.room_id.in_(list(room_ids))).distinct()
    )
    return {str(r[0]) for r in res}


async def sender_and_origin_ts(
    conn: AsyncConnection, room_id: str, event_id: str
) -> tuple[str, int] | None:
    """The event's sender and ``origin_server_ts`` (the native schema keeps no reception
    time)."""
    row = (
        await conn.execute(
            select(events.c.sender, events.c.origin_server_ts).where(
                events.c.event_id == event_id, events.c.room_id == room_id
            )
        )
    ).first()
    return None if row is None else (str(row[0]), int(row[1]))
