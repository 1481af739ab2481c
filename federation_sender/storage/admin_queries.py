"""The admin API's reads: destinations, their rooms and their transaction log, on the
native schema and on Synapse's (whose ``destinations`` and ``destination_rooms`` have
the same columns; the log is ours on both). :class:`AdminQueries` is the ``tx.admin``
of both backends.

Every function takes an open connection; the caller chooses the transaction. Sorting
is stable (ties broken by destination / room id / log id) and NULLs sort as the
smallest value on both PostgreSQL and SQLite, so pagination by offset is the same on
both backends.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import ColumnElement, Select, exists, func, select
from sqlalchemy.ext.asyncio import AsyncConnection

from federation_sender.model import (
    DestinationOrder,
    DestinationRow,
    Direction,
    TxnLogRow,
    event_ids_from_json,
)
from federation_sender.storage.schema import (
    destination_rooms,
    destinations,
    federation_transaction_log,
)

_D = destinations.c


def _ordered(column: ColumnElement[Any], direction: Direction) -> ColumnElement[Any]:
    if direction is Direction.FORWARDS:
        return column.asc().nulls_first()
    return column.desc().nulls_last()


def _sort_column(order_by: DestinationOrder) -> ColumnElement[Any]:
    if order_by is DestinationOrder.RETRY_LAST_TS:
        return func.coalesce(_D.retry_last_ts, 0)
    if order_by is DestinationOrder.RETRY_INTERVAL:
        return func.coalesce(_D.retry_interval, 0)
    col: ColumnElement[Any] = getattr(_D, order_by.value)
    return col


def _search(stmt: Select[Any], search: str | None) -> Select[Any]:
    if not search:
        return stmt
    return stmt.where(func.lower(_D.destination).contains(search.lower(), autoescape=True))


async def list_destinations(
    conn: AsyncConnection,
    *,
    start: int,
    limit: int,
    search: str | None = None,
    order_by: DestinationOrder = DestinationOrder.DESTINATION,
    direction: Direction = Direction.FORWARDS,
) -> tuple[list[DestinationRow], int]:
    """One page of ``destinations`` and the total matching ``search`` (a
    case-insensitive substring of the name)."""
    stmt = _search(select(_D.destination, _D.retry_last_ts, _D.retry_interval, _D.failure_ts,
                          _D.last_successful_stream_ordering), search)
    order = [_ordered(_sort_column(order_by), direction)]
    if order_by is not DestinationOrder.DESTINATION:
        order.append(_D.destination.asc())
    rows = (await conn.execute(stmt.order_by(*order).offset(start).limit(limit))).all()
    total = (await conn.execute(_search(select(func.count()).select_from(destinations),
                                        search))).scalar_one()
    return [DestinationRow(*r) for r in rows], int(total)


async def find_destination(conn: AsyncConnection, destination: str) -> DestinationRow | None:
    """The destination's retry timings; ``None`` when it is unknown.

    As in Synapse, a destination is known when it has a ``destinations`` row *or*
    appears in ``destination_rooms`` (the latter alone reads as never failed).
    """
    row = (await conn.execute(
        select(_D.destination, _D.retry_last_ts, _D.retry_interval, _D.failure_ts,
               _D.last_successful_stream_ordering).where(_D.destination == destination)
    )).first()
    if row is not None:
        return DestinationRow(*row)
    in_rooms = (await conn.execute(
        select(exists().where(destination_rooms.c.destination == destination))
    )).scalar_one()
    if in_rooms:
        return DestinationRow(destination, None, None, None, None)
    return None


async def list_destination_rooms(
    conn: AsyncConnection,
    destination: str,
    *,
    start: int,
    limit: int,
    direction: Direction = Direction.FORWARDS,
) -> tuple[list[tuple[str, int]], int]:
    """A page of ``(room_id, stream_ordering)`` for the destination, by room id."""
    r = destination_rooms.c
    order = r.room_id.asc() if direction is Direction.FORWARDS else r.room_id.desc()
    rows = (await conn.execute(
        select(r.room_id, r.stream_ordering).where(r.destination == destination)
        .order_by(order).offset(start).limit(limit)
    )).all()
    total = (await conn.execute(
        select(func.count()).select_from(destination_rooms).where(r.destination == destination)
    )).scalar_one()
    return [(str(room), int(so)) for room, so in rows], int(total)


async def list_transactions(
    conn: AsyncConnection,
    destination: str,
    *,
    start: int,
    limit: int,
    status: str | None = None,
) -> tuple[list[TxnLogRow], int]:
    """A page of the destination's transaction log, newest attempt first."""
    t = federation_transaction_log.c
    cond = [t.destination == destination]
    if status is not None:
        cond.append(t.status == status)
    rows = (await conn.execute(
        select(t.txn_id, t.instance_name, t.pdu_count, t.edu_count, t.request_bytes, t.status,
               t.http_status, t.started_ts, t.duration_ms, t.catchup, t.max_stream_ordering,
               t.pdu_event_ids, t.error)
        .where(*cond).order_by(t.started_ts.desc(), t.id.desc()).offset(start).limit(limit)
    )).all()
    total = (await conn.execute(
        select(func.count()).select_from(federation_transaction_log).where(*cond)
    )).scalar_one()
    out = [
        TxnLogRow(
            txn_id=r.txn_id, destination=destination, instance_name=r.instance_name,
            pdu_count=r.pdu_count,
            edu_count=r.edu_count, request_bytes=r.request_bytes, status=r.status,
            http_status=r.http_status, started_ts=r.started_ts, duration_ms=r.duration_ms,
            catchup=bool(r.catchup), max_stream_ordering=r.max_stream_ordering,
            pdu_event_ids=event_ids_from_json(r.pdu_event_ids), error=r.error,
        )
        for r in rows
    ]
    return out, int(total)


async def count_destinations_backing_off(conn: AsyncConnection) -> int:
    """Destinations with a retry scheduled (``retry_last_ts`` set, as Synapse tests)."""
    stmt = select(func.count()).select_from(destinations).where(_D.retry_last_ts > 0)
    return int((await conn.execute(stmt)).scalar_one())


class AdminQueries:
    """Implements :class:`federation_sender.storage.protocols.AdminReads` (both backends:
    Synapse's ``destinations`` and ``destination_rooms`` have the native columns, and
    the transaction log is ours on either)."""

    __slots__ = ("_c",)

    def __init__(self, conn: AsyncConnection) -> None:
        self._c = conn

    async def list_destinations(
        self,
        *,
        start: int,
        limit: int,
        search: str | None = None,
        order_by: DestinationOrder = DestinationOrder.DESTINATION,
        direction: Direction = Direction.FORWARDS,
    ) -> tuple[list[DestinationRow], int]:
        return await list_destinations(
            self._c, start=start, limit=limit, search=search, order_by=order_by,
            direction=direction,
        )

    async def find_destination(self, destination: str) -> DestinationRow | None:
        return await find_destination(self._c, destination)

    async def list_destination_rooms(
        self,
        destination: str,
        *,
        start: int,
        limit: int,
        direction: Direction = Direction.FORWARDS,
    ) -> tuple[list[tuple[str, int]], int]:
        return await list_destination_rooms(
            self._c, destination, start=start, limit=limit, direction=direction
        )

    async def list_transactions(
        self, destination: str, *, start: int, limit: int, status: str | None = None
    ) -> tuple[list[TxnLogRow], int]:
        return await list_transactions(
            self._c, destination, start=start, limit=limit, status=status
        )

    async def count_destinations_backing_off(self) -> int:
        return await count_destinations_backing_off(self._c)
