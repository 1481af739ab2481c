"""The batch jobs' writes to Synapse's ``destination_rooms`` and ``destinations``: what a
repair may do while Synapse and the worker run.

The rules are those of Synapse's own sender, so that a repair can race the worker and
never undo what it wrote:

* ``destination_rooms``: Synapse's ``store_destination_rooms_entries`` (first the
  destination's row in ``destinations``, then an upsert of ``(destination, room_id)``),
  with the worker's rule that the greater stream ordering wins: a row the worker wrote
  for a newer event while the job ran is kept. A repair only creates rows or raises
  them; it never deletes one (catch-up prunes rows of rooms a destination has left).
* ``destinations.last_successful_stream_ordering`` is only ever lowered, never raised,
  and retry timings are never touched. Lowering makes catch-up resend from there
  (receivers deduplicate by event id): the cost of a wrong repair is bandwidth, never
  a lost event.

No cache of Synapse's holds these two columns (``get_destination_retry_timings`` caches
the retry timings only), so unlike a retry write a repair needs no invalidation for
main.

The changes come from a staging table with the columns of
:data:`federation_sender.storage.batch_apply.STAGING_COLUMNS` (``action`` ``upsert`` or
``position``), made in our schema (``federation_sender``: never a table of Synapse's)
and filled by the job's executors over JDBC; :func:`apply_staged` applies it in the
caller's transaction.
"""

from __future__ import annotations

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from federation_sender.storage.batch_apply import (
    STAGING_COLUMNS,
    BatchCounts,
    checked_identifier,
)
from federation_sender.storage.batch_reads import DriverConnection
from federation_sender.storage.synapse.database import OWN_SCHEMA

_DESTINATIONS = (
    "INSERT INTO destinations (destination)"
    " SELECT DISTINCT destination FROM {staging} WHERE action = 'upsert'"
    " ON CONFLICT (destination) DO NOTHING"
)
_UPSERT = (
    "INSERT INTO destination_rooms (destination, room_id, stream_ordering)"
    " SELECT destination, room_id, max(stream_ordering) FROM {staging}"
    " WHERE action = 'upsert' GROUP BY destination, room_id"
    " ON CONFLICT (destination, room_id) DO UPDATE"
    " SET stream_ordering = excluded.stream_ordering"
    " WHERE destination_rooms.stream_ordering < excluded.stream_ordering"
)
_LOWER = (
    "UPDATE destinations d SET last_successful_stream_ordering = s.position"
    " FROM (SELECT destination, min(stream_ordering) AS position FROM {staging}"
    "       WHERE action = 'position' GROUP BY destination) s"
    " WHERE d.destination = s.destination"
    " AND d.last_successful_stream_ordering > s.position"
)


def staging_table(name: str) -> str:
    """The staging table's qualified name in our schema (``name``: a plain identifier)."""
    return f"{OWN_SCHEMA}.{checked_identifier(name)}"


def create_staging_table(conn: DriverConnection, name: str) -> None:
    """An UNLOGGED table in our schema for the executors to fill."""
    conn.execute(f"CREATE UNLOGGED TABLE {staging_table(name)} {STAGING_COLUMNS}")


def drop_staging_table(conn: DriverConnection, name: str) -> None:
    conn.execute(f"DROP TABLE IF EXISTS {staging_table(name)}")


async def apply_staged(conn: AsyncConnection, name: str) -> BatchCounts:
    """Apply the staging table ``name`` (see the module doc); ``upserted`` counts rows
    created or raised, ``deleted`` is always 0."""
    staging = staging_table(name)
    await conn.execute(text(_DESTINATIONS.format(staging=staging)))
    upserted = (await conn.execute(text(_UPSERT.format(staging=staging)))).rowcount
    lowered = (await conn.execute(text(_LOWER.format(staging=staging)))).rowcount
    return BatchCounts(max(0, upserted), 0, max(0, lowered))
