"""Reading ``events``, ``event_forward_extremities`` and ``partial_state_rooms``: the
reads, written once for every schema, and the native columns.

The queue engine only reads these tables (the main process writes them). Both schemas
keep events the same way where the queue engine looks (``events`` with a stream
ordering, ``event_forward_extremities``, ``partial_state_rooms``); they differ in which
columns make an :class:`EventRow` and how (the native ``events.json`` and ``rejected``,
below, against Synapse's ``events`` joined with ``event_json`` and its sending rules,
:mod:`.synapse.events`). A schema describes that in an :class:`EventSource`;
:class:`EventQueries` builds the statements once from it, and :class:`EventReads` is one
transaction's :class:`federation_sender.storage.protocols.EventReader` over them. Event
JSON is returned as text; callers parse it once and share the parsed PDU between
destinations.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import ColumnElement, FromClause, Table, bindparam, func, select
from sqlalchemy.ext.asyncio import AsyncConnection

from federation_sender.model import EventRow
from federation_sender.storage.schema import (
    event_forward_extremities,
    events,
    partial_state_rooms,
)


@dataclass(frozen=True)
class EventSource:
    """Where a schema keeps its events and how a row of ``cols`` becomes an event."""

    events: Table
    extremities: Table
    partial_state: Table
    cols: tuple[ColumnElement[Any], ...]
    """The columns :attr:`to_row` reads, selected from :attr:`from_`."""
    from_: FromClause
    to_row: Callable[[Sequence[Any]], EventRow]
    received_ts: ColumnElement[Any]
    """When the event reached us (the receipt pacing rule)."""


def _by_room(rows: Iterable[EventRow]) -> dict[str, list[EventRow]]:
    out: dict[str, list[EventRow]] = {}
    for e in rows:
        out.setdefault(e.room_id, []).append(e)
    return out


class EventQueries:
    """The statements of one schema, built once (statement construction costs more than
    the query; the intake and catch-up run them for every batch)."""

    def __init__(self, src: EventSource) -> None:
        ev, so = src.events, src.events.c.stream_ordering
        rows = select(*src.cols).select_from(src.from_)
        self._src = src
        self._max = select(func.max(so))
        self._after = (
            rows.where(so > bindparam("after"), so <= bindparam("upto"))
            .order_by(so).limit(bindparam("limit"))
        )
        self._so_after = select(so).where(so > bindparam("after")).order_by(so).limit(
            bindparam("limit")
        )
        self._at = rows.where(so.in_(bindparam("sos", expanding=True)))
        rn = func.row_number().over(partition_by=ev.c.room_id, order_by=so).label("rn")
        inner = (
            select(*src.cols, rn).select_from(src.from_)
            .where(ev.c.room_id.in_(bindparam("rooms", expanding=True)),
                   so > bindparam("after"), so <= bindparam("upto"))
            .subquery()
        )
        self._between = (
            select(*[inner.c[c.name] for c in src.cols])
            .where(inner.c.rn <= bindparam("per_room"))
            .order_by(inner.c.room_id, inner.c.stream_ordering)
        )
        self._nth_in_room = (
            select(so)
            .where(ev.c.room_id == bindparam("room"), so > bindparam("after"),
                   so <= bindparam("upto"))
            .order_by(so).offset(bindparam("n")).limit(1)
        )
        fx = src.extremities
        self._extremities = (
            select(*src.cols).select_from(src.from_.join(fx, fx.c.event_id == ev.c.event_id))
            .where(fx.c.room_id.in_(bindparam("rooms", expanding=True)))
            .order_by(so)
        )
        ps = src.partial_state
        self._partial = select(ps.c.room_id).where(
            ps.c.room_id.in_(bindparam("rooms", expanding=True))
        )
        self._sender_ts = select(ev.c.sender, src.received_ts).where(
            ev.c.event_id == bindparam("event"), ev.c.room_id == bindparam("room")
        )

    async def max_stream_ordering(self, conn: AsyncConnection) -> int:
        """Highest persisted stream ordering, 0 for an empty table (poll mode)."""
        v = (await conn.execute(self._max)).scalar()
        return int(v) if v is not None else 0

    async def stream_orderings_after(
        self, conn: AsyncConnection, after: int, limit: int
    ) -> list[int]:
        """Stream orderings of committed events above ``after``, lowest first."""
        res = await conn.execute(self._so_after, {"after": after, "limit": limit})
        return [int(v) for v in res.scalars()]

    async def events_after(
        self, conn: AsyncConnection, after: int, upto: int, limit: int
    ) -> list[EventRow]:
        """Events with ``after < stream_ordering <= upto``, oldest first, at most
        ``limit`` (Synapse's ``get_all_new_event_ids_stream``)."""
        res = await conn.execute(self._after, {"after": after, "upto": upto, "limit": limit})
        return [self._src.to_row(r) for r in res]

    async def events_at(
        self, conn: AsyncConnection, stream_orderings: Collection[int]
    ) -> dict[int, EventRow]:
        if not stream_orderings:
            return {}
        res = await conn.execute(self._at, {"sos": list(stream_orderings)})
        return {e.stream_ordering: e for e in map(self._src.to_row, res)}

    async def room_events_between(
        self, conn: AsyncConnection, room_ids: Collection[str], after: int, upto: int,
        per_room_limit: int,
    ) -> dict[str, list[EventRow]]:
        """For each room, its first ``per_room_limit`` events with
        ``after < so <= upto``, oldest first, in one query (a window function)."""
        if not room_ids:
            return {}
        res = await conn.execute(
            self._between,
            {"rooms": list(room_ids), "after": after, "upto": upto, "per_room": per_room_limit},
        )
        return _by_room(map(self._src.to_row, res))

    async def room_gap_longer_than(
        self, conn: AsyncConnection, room_id: str, after: int, upto: int, n: int
    ) -> bool:
        """Whether the room has more than ``n`` events with ``after < so <= upto``
        (reads at most ``n + 1`` index entries, no event)."""
        res = await conn.execute(
            self._nth_in_room, {"room": room_id, "after": after, "upto": upto, "n": n}
        )
        return res.first() is not None

    async def forward_extremities(
        self, conn: AsyncConnection, room_ids: Collection[str]
    ) -> dict[str, list[EventRow]]:
        """Each room's forward extremities that we have as events, oldest first."""
        if not room_ids:
            return {}
        res = await conn.execute(self._extremities, {"rooms": list(room_ids)})
        return _by_room(map(self._src.to_row, res))

    async def partial_state(self, conn: AsyncConnection, room_ids: Collection[str]) -> set[str]:
        if not room_ids:
            return set()
        res = await conn.execute(self._partial, {"rooms": list(room_ids)})
        return {str(r[0]) for r in res}

    async def sender_and_received_ts(
        self, conn: AsyncConnection, room_id: str, event_id: str
    ) -> tuple[str, int] | None:
        res = await conn.execute(self._sender_ts, {"event": event_id, "room": room_id})
        row = res.first()
        if row is None or row[1] is None:
            return None
        return str(row[0]), int(row[1])


class EventReads:
    """Implements :class:`federation_sender.storage.protocols.EventReader`: one
    transaction's reads over a schema's :class:`EventQueries`."""

    __slots__ = ("_c", "_q")

    def __init__(self, conn: AsyncConnection, queries: EventQueries) -> None:
        self._c = conn
        self._q = queries

    async def max_stream_ordering(self) -> int:
        return await self._q.max_stream_ordering(self._c)

    async def events_after(self, after: int, upto: int, limit: int) -> list[EventRow]:
        return await self._q.events_after(self._c, after, upto, limit)

    async def stream_orderings_after(self, after: int, limit: int) -> list[int]:
        return await self._q.stream_orderings_after(self._c, after, limit)

    async def events_at(self, stream_orderings: Collection[int]) -> dict[int, EventRow]:
        return await self._q.events_at(self._c, stream_orderings)

    async def room_events_between(
        self, room_ids: Collection[str], after: int, upto: int, per_room_limit: int
    ) -> dict[str, list[EventRow]]:
        return await self._q.room_events_between(self._c, room_ids, after, upto, per_room_limit)

    async def room_gap_longer_than(self, room_id: str, after: int, upto: int, n: int) -> bool:
        return await self._q.room_gap_longer_than(self._c, room_id, after, upto, n)

    async def forward_extremities(self, room_ids: Collection[str]) -> dict[str, list[EventRow]]:
        return await self._q.forward_extremities(self._c, room_ids)

    async def partial_state(self, room_ids: Collection[str]) -> set[str]:
        return await self._q.partial_state(self._c, room_ids)

    async def sender_and_received_ts(self, room_id: str, event_id: str) -> tuple[str, int] | None:
        return await self._q.sender_and_received_ts(self._c, room_id, event_id)


# The native schema's events.

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
