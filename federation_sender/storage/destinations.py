"""``destinations`` (backoff, catch-up position) and ``destination_rooms``: the rules,
written once, and the native tables.

The statements are the native schema's on SQLite and PostgreSQL; Synapse's two tables
have the same columns, so its dialect (:mod:`.synapse.destinations`) is
:class:`DestinationsTable` on a PostgreSQL connection with what Synapse adds (each
retry write an invalidation for main, catch-up rows only for events that still exist,
outboxes whose rows are deleted once sent). Invariants kept here rather than in callers:

* ``retry_interval`` never moves backwards except through an explicit reset to 0 (two
  writers racing cannot shorten a backoff).
* ``last_successful_stream_ordering`` and ``destination_rooms.stream_ordering`` only
  move forwards here, a position only over the value its queue knows (a batch repair,
  :mod:`.batch_apply`, is the one writer that lowers positions).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from sqlalchemy import (
    and_,
    bindparam,
    delete,
    exists,
    false,
    func,
    or_,
    select,
    text,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection

from federation_sender.model import DestinationRow
from federation_sender.storage import batch_apply
from federation_sender.storage.batch_apply import BatchCounts, StagedChange
from federation_sender.storage.pgarray import bigint_array, text_array
from federation_sender.storage.schema import (
    destination_rooms as dr,
)
from federation_sender.storage.schema import (
    destinations as d,
)
from federation_sender.storage.schema import (
    device_federation_outbox as tdo,
)
from federation_sender.storage.schema import (
    device_lists_outbound_pokes as dlp,
)


def _insert(conn: AsyncConnection):  # type: ignore[no-untyped-def]
    return postgresql.insert if conn.dialect.name == "postgresql" else sqlite.insert


def _is_pg(conn: AsyncConnection) -> bool:
    return conn.dialect.name == "postgresql"


async def upsert_destination_rooms(
    conn: AsyncConnection,
    rows: Sequence[tuple[str, str, int]],
    *,
    skip_destinations: bool = False,
) -> None:
    """Record (destination, room_id, stream_ordering) in one statement (PostgreSQL:
    ``unnest`` of arrays; SQLite: executemany); creates missing destinations unless the
    caller knows they all exist.

    For one (destination, room) the highest stream ordering wins."""
    if not rows:
        return
    best: dict[tuple[str, str], int] = {}
    for dest, room, so in rows:
        k = (dest, room)
        if best.get(k, -1) < so:
            best[k] = so
    if not skip_destinations:
        await ensure_destinations(conn, {k[0] for k in best})
    items = sorted(best.items())
    if _is_pg(conn):
        await conn.execute(
            text(
                "INSERT INTO destination_rooms (destination, room_id, stream_ordering)"
                " SELECT * FROM unnest(CAST(:d AS text[]), CAST(:r AS text[]),"
                " CAST(:s AS bigint[]))"
                " ON CONFLICT (destination, room_id) DO UPDATE"
                " SET stream_ordering = EXCLUDED.stream_ordering"
                " WHERE destination_rooms.stream_ordering < EXCLUDED.stream_ordering"
            ),
            {
                "d": text_array([k[0] for k, _ in items]),
                "r": text_array([k[1] for k, _ in items]),
                "s": bigint_array([so for _, so in items]),
            },
        )
        return
    stmt = sqlite.insert(dr)
    stmt = stmt.on_conflict_do_update(
        index_elements=["destination", "room_id"],
        set_={"stream_ordering": stmt.excluded.stream_ordering},
        where=dr.c.stream_ordering < stmt.excluded.stream_ordering,
    )
    await conn.execute(
        stmt,
        [{"destination": k[0], "room_id": k[1], "stream_ordering": so} for k, so in items],
    )


_DCOLS = (
    d.c.destination,
    d.c.retry_last_ts,
    d.c.retry_interval,
    d.c.failure_ts,
    d.c.last_successful_stream_ordering,
)


_GET_DESTINATION = select(*_DCOLS).where(d.c.destination == bindparam("dest"))


async def get_destination(conn: AsyncConnection, destination: str) -> DestinationRow | None:
    r = (await conn.execute(_GET_DESTINATION, {"dest": destination})).first()
    return None if r is None else DestinationRow.from_columns(tuple(r))


async def get_destinations(
    conn: AsyncConnection, names: Collection[str]
) -> dict[str, DestinationRow]:
    if not names:
        return {}
    res = await conn.execute(select(*_DCOLS).where(d.c.destination.in_(list(names))))
    return {row.destination: row for row in map(DestinationRow.from_columns, res)}


RETRY_UPSERT = (
    "INSERT INTO destinations (destination, failure_ts, retry_last_ts, retry_interval)"
    " VALUES (:destination, :failure_ts, :retry_last_ts, :retry_interval)"
    " ON CONFLICT (destination) DO UPDATE SET failure_ts = excluded.failure_ts,"
    " retry_last_ts = excluded.retry_last_ts, retry_interval = excluded.retry_interval"
    " WHERE excluded.retry_interval = 0 OR excluded.retry_last_ts = 0"
    " OR destinations.retry_interval IS NULL"
    " OR destinations.retry_interval < excluded.retry_interval"
    " OR destinations.retry_last_ts < excluded.retry_last_ts"
)
"""Synapse's retry rule (``_set_destination_retry_timings_txn``): a reset, a first row,
a longer interval or a later attempt replaces the stored one."""
_SET_RETRY_TIMINGS = text(RETRY_UPSERT)
"""One text for PostgreSQL and SQLite (both speak this ON CONFLICT): SQLAlchemy cannot
cache a dialect ``insert().on_conflict_do_update()`` and compiled it on every call, 7 %
of the engine's CPU when 10,000 destinations come back at once (``bench/recovery.py``)."""


async def set_retry_timings(
    conn: AsyncConnection,
    destination: str,
    failure_ts: int | None,
    retry_last_ts: int,
    retry_interval: int,
) -> None:
    """Persist backoff, with Synapse's condition: ``retry_interval == 0`` resets;
    otherwise the stored row is replaced by a longer interval or a later attempt
    (``retry_last_ts`` advances at every attempt, also once the interval is at its cap),
    never by an older attempt's."""
    await conn.execute(
        _SET_RETRY_TIMINGS,
        {
            "destination": destination,
            "failure_ts": failure_ts,
            "retry_last_ts": retry_last_ts,
            "retry_interval": retry_interval,
        },
    )


async def set_last_successful_stream_ordering(
    conn: AsyncConnection, destination: str, stream_ordering: int
) -> None:
    ins = _insert(conn)
    stmt = ins(d).values(destination=destination, last_successful_stream_ordering=stream_ordering)
    stmt = stmt.on_conflict_do_update(
        index_elements=["destination"],
        set_={"last_successful_stream_ordering": stmt.excluded.last_successful_stream_ordering},
        where=or_(
            d.c.last_successful_stream_ordering.is_(None),
            d.c.last_successful_stream_ordering
            < stmt.excluded.last_successful_stream_ordering,
        ),
    )
    await conn.execute(stmt)


_PG_POSITIONS_UPDATE = text(
    "UPDATE destinations d SET last_successful_stream_ordering = u.s"
    " FROM unnest(CAST(:d AS text[]), CAST(:s AS bigint[]), CAST(:b AS bigint[]))"
    " AS u(d, s, b)"
    " WHERE d.destination = u.d"
    " AND COALESCE(d.last_successful_stream_ordering, -1) = u.b"
    " AND COALESCE(d.last_successful_stream_ordering, -1) < u.s"
)
_PG_POSITIONS_INSERT = text(
    "INSERT INTO destinations (destination, last_successful_stream_ordering)"
    " SELECT * FROM unnest(CAST(:d AS text[]), CAST(:s AS bigint[]))"
    " ON CONFLICT (destination) DO NOTHING"
)
_SQLITE_POSITIONS_UPDATE = text(
    "UPDATE destinations SET last_successful_stream_ordering = :s"
    " WHERE destination = :d AND COALESCE(last_successful_stream_ordering, -1) = :b"
    " AND COALESCE(last_successful_stream_ordering, -1) < :s"
)
_SQLITE_POSITIONS_INSERT = text(
    "INSERT INTO destinations (destination, last_successful_stream_ordering)"
    " VALUES (:d, :s) ON CONFLICT (destination) DO NOTHING"
)


async def set_last_successful_many(
    conn: AsyncConnection, positions: Sequence[tuple[str, int, int]]
) -> None:
    """Move positions forwards, each ``(destination, position, before)`` only over
    ``before``, the value its queue knows (-1 for none; a destination without a row gets
    one only then). A position another process changed meanwhile (``batch audit
    --repair`` lowers one past events it found lost) is left as it is: the queue reads
    it again (the wake-up sweep) rather than raise it past what it owes. Several writes
    of one destination in one call chain: the newest position over the oldest's
    ``before``. One round trip per statement whatever their number."""
    if not positions:
        return
    best: dict[str, tuple[int, int]] = {}
    for dest, so, before in positions:
        seen = best.get(dest)
        best[dest] = (so, before) if seen is None else (max(so, seen[0]), seen[1])
    items = sorted(best.items())
    fresh = [(k, so) for k, (so, before) in items if before == -1]
    if _is_pg(conn):
        await conn.execute(_PG_POSITIONS_UPDATE, {
            "d": text_array([k for k, _ in items]),
            "s": bigint_array([so for _, (so, _b) in items]),
            "b": bigint_array([b for _, (_so, b) in items]),
        })
        if fresh:
            await conn.execute(_PG_POSITIONS_INSERT, {
                "d": text_array([k for k, _ in fresh]),
                "s": bigint_array([so for _, so in fresh]),
            })
        return
    await conn.execute(_SQLITE_POSITIONS_UPDATE,
                       [{"d": k, "s": so, "b": b} for k, (so, b) in items])
    if fresh:
        await conn.execute(_SQLITE_POSITIONS_INSERT, [{"d": k, "s": so} for k, so in fresh])


async def delete_destination_rooms(
    conn: AsyncConnection, destination: str, rows: Sequence[tuple[str, int]]
) -> None:
    """Prune rows, each only if it still has the given stream ordering (a newer event
    for the room since planning keeps the row)."""
    for room, so in rows:
        await conn.execute(
            delete(dr).where(
                dr.c.destination == destination,
                dr.c.room_id == room,
                dr.c.stream_ordering == so,
            )
        )


async def destinations_with_outstanding_work(
    conn: AsyncConnection, after: str | None, limit: int, now_ms: int
) -> list[tuple[str, int | None]]:
    """Keyset page (by name) of destinations not backing off at ``now_ms`` that have
    ``destination_rooms`` past their position or unsent outbox rows, with that
    position."""
    behind = exists().where(
        dr.c.destination == d.c.destination,
        dr.c.stream_ordering > func.coalesce(d.c.last_successful_stream_ordering, -1),
    )
    to_device = exists().where(tdo.c.destination == d.c.destination, tdo.c.sent_ts.is_(None))
    dev_lists = exists().where(dlp.c.destination == d.c.destination, dlp.c.sent == false())
    not_backing_off = or_(
        d.c.retry_interval.is_(None),
        d.c.retry_interval == 0,
        d.c.retry_last_ts.is_(None),
        d.c.retry_last_ts + d.c.retry_interval <= now_ms,
    )
    cond = and_(not_backing_off, or_(behind, to_device, dev_lists))
    if after is not None:
        cond = and_(cond, d.c.destination > after)
    res = await conn.execute(
        select(d.c.destination, d.c.last_successful_stream_ordering)
        .where(cond).order_by(d.c.destination).limit(limit)
    )
    return [(str(r[0]), None if r[1] is None else int(r[1])) for r in res]


async def ensure_destinations(conn: AsyncConnection, names: Collection[str]) -> None:
    if not names:
        return
    if _is_pg(conn):
        await conn.execute(
            text(
                "INSERT INTO destinations (destination)"
                " SELECT unnest(CAST(:d AS text[])) ON CONFLICT DO NOTHING"
            ),
            {"d": text_array(sorted(names))},
        )
        return
    await conn.execute(
        sqlite.insert(d).on_conflict_do_nothing(index_elements=["destination"]),
        [{"destination": x} for x in sorted(names)],
    )


async def clear_retry(conn: AsyncConnection, destination: str) -> bool:
    """Reset backoff; True if the destination was backing off."""
    res = await conn.execute(
        update(d)
        .where(d.c.destination == destination, d.c.retry_interval > 0)
        .values(retry_interval=0, failure_ts=None, retry_last_ts=0)
    )
    return bool(res.rowcount)


async def clear_retry_many(conn: AsyncConnection, destinations: Collection[str]) -> None:
    """Reset the backoff of destinations that just accepted a transaction, whoever wrote
    it (another instance sharing the database); rows not backing off are untouched."""
    if not destinations:
        return
    if _is_pg(conn):
        # One statement text whatever the group's size (an IN list is a new text, and so
        # a new parse and plan, for every size), its names in one array parameter.
        await conn.execute(_PG_CLEAR_RETRY_MANY, {"d": text_array(sorted(destinations))})
        return
    await conn.execute(
        update(d)
        .where(d.c.destination.in_(sorted(destinations)), d.c.retry_interval > 0)
        .values(retry_interval=0, failure_ts=None, retry_last_ts=0)
    )


_PG_CLEAR_RETRY_MANY = text(
    "UPDATE destinations SET retry_interval = 0, failure_ts = NULL, retry_last_ts = 0"
    " WHERE destination = ANY(CAST(:d AS text[])) AND retry_interval > 0"
)


async def destinations_behind(conn: AsyncConnection) -> list[str]:
    """Destinations with ``destination_rooms`` rows past their position (at startup these
    need catch-up; every other destination's queue can start sending at once)."""
    res = await conn.execute(
        select(dr.c.destination)
        .join(d, d.c.destination == dr.c.destination, isouter=True)
        .where(dr.c.stream_ordering > func.coalesce(d.c.last_successful_stream_ordering, -1))
        .distinct()
    )
    return [str(r[0]) for r in res]


class DestinationsTable:
    """Implements :class:`federation_sender.storage.protocols.DestinationStore` on one
    connection, with the statements above (the native schema on SQLite or PostgreSQL;
    the Synapse dialect derives from it)."""

    __slots__ = ("_c",)

    def __init__(self, conn: AsyncConnection) -> None:
        self._c = conn

    async def get_destination(self, destination: str) -> DestinationRow | None:
        return await get_destination(self._c, destination)

    async def get_destinations(self, names: Collection[str]) -> dict[str, DestinationRow]:
        return await get_destinations(self._c, names)

    async def ensure_destinations(self, names: Collection[str]) -> None:
        await ensure_destinations(self._c, names)

    async def set_retry_timings(
        self, destination: str, failure_ts: int | None, retry_last_ts: int, retry_interval: int
    ) -> None:
        await set_retry_timings(self._c, destination, failure_ts, retry_last_ts, retry_interval)

    async def clear_retry(self, destination: str) -> bool:
        return await clear_retry(self._c, destination)

    async def clear_retry_many(self, destinations: Collection[str]) -> None:
        await clear_retry_many(self._c, destinations)

    async def set_last_successful_many(
        self, positions: Sequence[tuple[str, int, int]]
    ) -> None:
        await set_last_successful_many(self._c, positions)

    async def upsert_destination_rooms(
        self, rows: Sequence[tuple[str, str, int]], *, skip_destinations: bool = False
    ) -> None:
        await upsert_destination_rooms(self._c, rows, skip_destinations=skip_destinations)

    async def delete_destination_rooms(
        self, destination: str, rows: Sequence[tuple[str, int]]
    ) -> None:
        await delete_destination_rooms(self._c, destination, rows)

    async def destinations_behind(self) -> list[str]:
        return await destinations_behind(self._c)

    async def destinations_with_outstanding_work(
        self, after: str | None, limit: int, now_ms: int
    ) -> list[tuple[str, int | None]]:
        return await destinations_with_outstanding_work(self._c, after, limit, now_ms)

    async def apply_batch(
        self, changes: Sequence[StagedChange], high_water_mark: int
    ) -> BatchCounts:
        return await batch_apply.apply_changes(self._c, changes, high_water_mark)

    async def apply_staged_batch(self, staging: str, high_water_mark: int) -> BatchCounts:
        return await batch_apply.apply_staged(self._c, staging, high_water_mark)
