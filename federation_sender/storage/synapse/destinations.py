"""Synapse's ``destinations`` and ``destination_rooms``: the shared table
(:class:`federation_sender.storage.destinations.DestinationsTable`, whose PostgreSQL
statements fit Synapse's columns) with what Synapse's own federation sender adds.

* ``destinations``: retry timings with Synapse's upsert (``transactions.py:
  _set_destination_retry_timings_txn``: a reset, a first row, a longer interval or a
  later attempt replaces the stored one), each write recorded as a cache invalidation
  of ``get_destination_retry_timings`` for main; ``last_successful_stream_ordering``
  only moves forwards.
* ``destination_rooms``: upserted, highest stream ordering per (destination, room)
  (the shared statement); catch-up reads only rows whose event still exists.
* ``cache_invalidation_stream_by_instance``: one row per invalidation under our instance
  name, its id from ``cache_invalidation_stream_seq`` (as Synapse's
  ``_send_invalidation_to_replication``); the same row is published over replication
  after the commit (:mod:`.signals`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from federation_sender.storage.catchup import CatchupQuery
from federation_sender.storage.destinations import RETRY_UPSERT, DestinationsTable
from federation_sender.storage.pgarray import text_array
from federation_sender.storage.schema import destination_rooms
from federation_sender.storage.synapse.schema import events
from federation_sender.storage.synapse.signals import PendingSignals

RETRY_TIMINGS_CACHE = "get_destination_retry_timings"


_RETRY_UPSERT = text(
    """
    WITH old AS (
        SELECT retry_last_ts FROM destinations WHERE destination = :destination FOR UPDATE
    ), up AS (
    """
    + RETRY_UPSERT
    + """
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

_BACKING_OFF = text(
    "SELECT destination FROM destinations"
    " WHERE destination = ANY(CAST(:d AS text[])) AND retry_interval > 0"
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
    SELECT d.destination, d.last_successful_stream_ordering FROM destinations d
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

CATCHUP = CatchupQuery(destination_rooms, events)
"""Synapse's ``get_catch_up_room_event_ids``: rows whose event still exists."""


async def backing_off(conn: AsyncConnection, names: Collection[str]) -> list[str]:
    """Of ``names``, those with a backoff recorded, sorted: one array literal whatever
    their number (an ``IN`` list binds one parameter per name, and the group commit
    asks this for every destination it saw succeed)."""
    if not names:
        return []
    res = await conn.execute(_BACKING_OFF, {"d": text_array(names)})
    return sorted(str(r[0]) for r in res)


class SynapseDestinations(DestinationsTable):
    """Implements :class:`federation_sender.storage.protocols.DestinationStore` on
    Synapse's tables: every retry write is also a cache invalidation for main (and a
    reset of a destination that was backing off a ``REMOTE_SERVER_UP``), recorded in
    ``signals`` for after the commit."""

    __slots__ = ("_instance", "_now_ms", "_s")

    def __init__(
        self, conn: AsyncConnection, signals: PendingSignals, instance: str,
        now_ms: Callable[[], int],
    ) -> None:
        super().__init__(conn)
        self._s = signals
        self._instance = instance
        self._now_ms = now_ms

    async def _invalidate(self, cache_func: str, keys: list[str]) -> None:
        now = self._now_ms()
        params = {"instance": self._instance, "func": cache_func, "keys": keys, "ts": now}
        stream_id = (await self._c.execute(_INVALIDATE, params)).scalar_one()
        self._s.invalidations.append((int(stream_id), cache_func, keys, now))

    async def _set_retry(
        self, destination: str, failure_ts: int | None, retry_last_ts: int, retry_interval: int
    ) -> bool:
        """Synapse's upsert and invalidation; returns whether a backoff was cleared (a
        reset of a destination that was backing off: it came back)."""
        params = {
            "destination": destination,
            "failure_ts": failure_ts,
            "retry_last_ts": retry_last_ts,
            "retry_interval": retry_interval,
        }
        old_last, _changed = (await self._c.execute(_RETRY_UPSERT, params)).one()
        await self._invalidate(RETRY_TIMINGS_CACHE, [destination])
        came_back = retry_interval == 0 and bool(old_last)
        if came_back:
            self._s.servers_up.append(destination)
        return came_back

    async def set_retry_timings(
        self, destination: str, failure_ts: int | None, retry_last_ts: int, retry_interval: int
    ) -> None:
        await self._set_retry(destination, failure_ts, retry_last_ts, retry_interval)

    async def clear_retry(self, destination: str) -> bool:
        row = await self.get_destination(destination)
        if row is None or not row.retry_interval:
            return False
        return await self._set_retry(destination, None, 0, 0)

    async def clear_retry_many(self, destinations: Collection[str]) -> None:
        """Only rows backing off are written (each write is an invalidation for main)."""
        for d in await backing_off(self._c, destinations):
            await self._set_retry(d, None, 0, 0)

    async def destinations_behind(self) -> list[str]:
        return sorted(str(r[0]) for r in await self._c.execute(_BEHIND))

    async def destinations_with_outstanding_work(
        self, after: str | None, limit: int, now_ms: int
    ) -> list[tuple[str, int | None]]:
        res = await self._c.execute(_OUTSTANDING, {"after": after, "limit": limit, "now": now_ms})
        return [(str(r[0]), None if r[1] is None else int(r[1])) for r in res]
