"""What we write to Synapse's tables, as Synapse's own federation sender writes it.

* ``destinations``: retry timings with Synapse's upsert (``transactions.py:
  _set_destination_retry_timings_txn``: a reset, a first row, a longer interval or a
  later attempt replaces the stored one), each write recorded as a cache invalidation
  of ``get_destination_retry_timings`` for main; ``last_successful_stream_ordering``
  only moves forwards.
* ``destination_rooms``: upserted, highest stream ordering per (destination, room).
* ``cache_invalidation_stream_by_instance``: one row per invalidation under our instance
  name, its id from ``cache_invalidation_stream_seq`` (as Synapse's
  ``_send_invalidation_to_replication``); the same row is published over replication
  after the commit (:mod:`.signals`).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from sqlalchemy import select, text
from sqlalchemy.ext.asyncio import AsyncConnection

from federation_sender.model import DestinationRow
from federation_sender.storage.pgarray import bigint_array, text_array
from federation_sender.storage.synapse.schema import (
    destination_rooms,
    destinations,
)
from federation_sender.storage.synapse.signals import PendingSignals

RETRY_TIMINGS_CACHE = "get_destination_retry_timings"


_RETRY_UPSERT = text(
    """
    WITH old AS (
        SELECT retry_last_ts FROM destinations WHERE destination = :d FOR UPDATE
    ), up AS (
        INSERT INTO destinations (destination, failure_ts, retry_last_ts, retry_interval)
        VALUES (:d, :failure_ts, :retry_last_ts, :retry_interval)
        ON CONFLICT (destination) DO UPDATE SET
            failure_ts = EXCLUDED.failure_ts,
            retry_last_ts = EXCLUDED.retry_last_ts,
            retry_interval = EXCLUDED.retry_interval
        WHERE EXCLUDED.retry_interval = 0
           OR EXCLUDED.retry_last_ts = 0
           OR destinations.retry_interval IS NULL
           OR destinations.retry_interval < EXCLUDED.retry_interval
           OR destinations.retry_last_ts < EXCLUDED.retry_last_ts
        RETURNING 1
    )
    SELECT (SELECT retry_last_ts FROM old), EXISTS (SELECT 1 FROM up)
    """
)

_INVALIDATE = text(
    """
    INSERT INTO cache_invalidation_stream_by_instance
        (stream_id, instance_name, cache_func, keys, invalidation_ts)
    VALUES (nextval('cache_invalidation_stream_seq'), :instance, :func, :keys, :ts)
    RETURNING stream_id
    """
)


_DEST_COLS = (
    destinations.c.destination,
    destinations.c.retry_last_ts,
    destinations.c.retry_interval,
    destinations.c.failure_ts,
    destinations.c.last_successful_stream_ordering,
)


async def get_destinations(
    conn: AsyncConnection, names: Collection[str]
) -> dict[str, DestinationRow]:
    if not names:
        return {}
    res = await conn.execute(select(*_DEST_COLS).where(destinations.c.destination.in_(list(names))))
    return {row.destination: row for row in map(DestinationRow.from_columns, res)}


_BACKING_OFF = text(
    "SELECT destination FROM destinations"
    " WHERE destination = ANY(CAST(:d AS text[])) AND retry_interval > 0"
)


async def backing_off(conn: AsyncConnection, names: Collection[str]) -> list[str]:
    """Of ``names``, those with a backoff recorded, sorted: one array literal whatever
    their number (an ``IN`` list binds one parameter per name, and the group commit
    asks this for every destination it saw succeed)."""
    if not names:
        return []
    res = await conn.execute(_BACKING_OFF, {"d": text_array(names)})
    return sorted(str(r[0]) for r in res)


# The multi-row writes are text over ``unnest`` of arrays: one statement whatever the
# row count, so SQLAlchemy compiles it once. A dialect ``insert().values([...])
# .on_conflict_do_update()`` cannot be cached and was compiled on every call: 15 % of the
# worker's event loop in the 415-destination race (``bench/synapse_compare.py``).
_ENSURE_DESTINATIONS = text(
    "INSERT INTO destinations (destination) SELECT unnest(CAST(:d AS text[]))"
    " ON CONFLICT (destination) DO NOTHING"
)
_SET_LAST_SUCCESSFUL_MANY = text(
    "INSERT INTO destinations (destination, last_successful_stream_ordering)"
    " SELECT * FROM unnest(CAST(:d AS text[]), CAST(:s AS bigint[]))"
    " ON CONFLICT (destination) DO UPDATE SET last_successful_stream_ordering ="
    " GREATEST(destinations.last_successful_stream_ordering,"
    " EXCLUDED.last_successful_stream_ordering)"
)
_UPSERT_DESTINATION_ROOMS = text(
    "INSERT INTO destination_rooms (destination, room_id, stream_ordering)"
    " SELECT * FROM unnest(CAST(:d AS text[]), CAST(:r AS text[]), CAST(:s AS bigint[]))"
    " ON CONFLICT (destination, room_id) DO UPDATE SET stream_ordering ="
    " EXCLUDED.stream_ordering"
    " WHERE destination_rooms.stream_ordering < EXCLUDED.stream_ordering"
)


async def ensure_destinations(conn: AsyncConnection, names: Collection[str]) -> None:
    if names:
        await conn.execute(_ENSURE_DESTINATIONS, {"d": text_array(sorted(names))})


async def invalidate(
    conn: AsyncConnection,
    signals: PendingSignals,
    instance: str,
    cache_func: str,
    keys: list[str],
    now_ms: int,
) -> int:
    stream_id = (
        await conn.execute(
            _INVALIDATE, {"instance": instance, "func": cache_func, "keys": keys, "ts": now_ms}
        )
    ).scalar_one()
    signals.invalidations.append((int(stream_id), cache_func, keys, now_ms))
    return int(stream_id)


async def set_retry_timings(
    conn: AsyncConnection,
    signals: PendingSignals,
    instance: str,
    now_ms: int,
    destination: str,
    failure_ts: int | None,
    retry_last_ts: int,
    retry_interval: int,
) -> bool:
    """Synapse's upsert and invalidation; returns whether a backoff was cleared (a
    reset of a destination that was backing off: it came back)."""
    old_last, _changed = (
        await conn.execute(
            _RETRY_UPSERT,
            {
                "d": destination,
                "failure_ts": failure_ts,
                "retry_last_ts": retry_last_ts,
                "retry_interval": retry_interval,
            },
        )
    ).one()
    await invalidate(conn, signals, instance, RETRY_TIMINGS_CACHE, [destination], now_ms)
    came_back = retry_interval == 0 and bool(old_last)
    if came_back:
        signals.servers_up.append(destination)
    return came_back


async def set_last_successful_many(
    conn: AsyncConnection, positions: Sequence[tuple[str, int]]
) -> None:
    if not positions:
        return
    best: dict[str, int] = {}
    for d, so in positions:
        best[d] = max(so, best.get(d, so))
    items = sorted(best.items())
    await conn.execute(
        _SET_LAST_SUCCESSFUL_MANY,
        {"d": text_array([d for d, _ in items]), "s": bigint_array([so for _, so in items])},
    )


async def upsert_destination_rooms(
    conn: AsyncConnection, rows: Sequence[tuple[str, str, int]]
) -> None:
    if not rows:
        return
    best: dict[tuple[str, str], int] = {}
    for d, room, so in rows:
        key = (d, room)
        best[key] = max(so, best.get(key, so))
    items = sorted(best.items())
    await conn.execute(
        _UPSERT_DESTINATION_ROOMS,
        {
            "d": text_array([d for (d, _), _ in items]),
            "r": text_array([room for (_, room), _ in items]),
            "s": bigint_array([so for _, so in items]),
        },
    )


async def delete_destination_rooms(
    conn: AsyncConnection, destination: str, rows: Sequence[tuple[str, int]]
) -> None:
    t = destination_rooms
    for room, so in rows:
        await conn.execute(
            t.delete().where(
                t.c.destination == destination, t.c.room_id == room, t.c.stream_ordering == so
            )
        )


_BEHIND = text(
    """
    SELECT DISTINCT r.destination FROM destination_rooms r
    JOIN destinations d USING (destination)
    WHERE r.stream_ordering > COALESCE(d.last_successful_stream_ordering, -1)
    """
)

_OUTSTANDING = text(
    """
    SELECT d.destination FROM destinations d
    WHERE (CAST(:after AS TEXT) IS NULL OR d.destination > CAST(:after AS TEXT))
      AND (COALESCE(d.retry_last_ts, 0) = 0
           OR d.retry_last_ts + COALESCE(d.retry_interval, 0) <= :now)
      AND (EXISTS (SELECT 1 FROM destination_rooms r WHERE r.destination = d.destination
                   AND r.stream_ordering > COALESCE(d.last_successful_stream_ordering, -1))
           OR EXISTS (SELECT 1 FROM device_federation_outbox o
                      WHERE o.destination = d.destination)
           OR EXISTS (SELECT 1 FROM device_lists_outbound_pokes p
                      WHERE p.destination = d.destination))
    ORDER BY d.destination
    LIMIT :limit
    """
)


async def destinations_behind(conn: AsyncConnection) -> list[str]:
    return sorted(str(r[0]) for r in await conn.execute(_BEHIND))


async def destinations_with_outstanding_work(
    conn: AsyncConnection, after: str | None, limit: int, now_ms: int
) -> list[str]:
    res = await conn.execute(_OUTSTANDING, {"after": after, "limit": limit, "now": now_ms})
    return [str(r[0]) for r in res]
