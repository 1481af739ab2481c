"""The batch jobs' writes to ``destination_rooms`` and ``destinations``, written once for
every dialect.

A Spark job (``batch/``) fixes a high-water mark H and computes changes from the events
up to H; the worker meanwhile goes on writing rows for newer events. The apply rule is
therefore not the worker's: a ``destination_rooms`` row is upserted or deleted only if
its stored stream ordering is at most H (so a batch result never undoes a newer write),
and a destination's ``last_successful_stream_ordering`` is only ever lowered (or set
where none is stored), never raised.

The changes come from a staging table with the columns (``destination``, ``room_id``,
``stream_ordering``, ``action``), ``action`` one of ``upsert``, ``delete`` and
``position`` (then ``stream_ordering`` is the position): on PostgreSQL the job's
executors fill an UNLOGGED table over JDBC (:func:`apply_staged`); a small result is
staged here into a temporary table (:func:`apply_changes`, the embedded SQLite
database's path). Either way the same three set-based statements apply it, in the
caller's transaction.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Sequence
from typing import NamedTuple

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

StagedChange = tuple[str, str | None, int | None, str]
"""(destination, room_id, stream_ordering, action): one row of the staging table."""

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")

STAGING_COLUMNS = (
    "(destination TEXT NOT NULL, room_id TEXT, stream_ordering BIGINT, action TEXT NOT NULL)"
)
"""The staging table's columns, whichever way it is made (UNLOGGED over JDBC:
:func:`federation_sender.storage.batch_reads.create_staging_table`; temporary here)."""


class BatchCounts(NamedTuple):
    upserted: int
    deleted: int
    positions_lowered: int


_UPSERT = (
    "INSERT INTO destination_rooms (destination, room_id, stream_ordering)"
    " SELECT destination, room_id, stream_ordering FROM {staging} WHERE action = 'upsert'"
    " ON CONFLICT (destination, room_id) DO UPDATE"
    " SET stream_ordering = excluded.stream_ordering"
    " WHERE destination_rooms.stream_ordering <= :hwm"
)
_DELETE = (
    "DELETE FROM destination_rooms WHERE stream_ordering <= :hwm AND EXISTS ("
    " SELECT 1 FROM {staging} s WHERE s.action = 'delete'"
    " AND s.destination = destination_rooms.destination"
    " AND s.room_id = destination_rooms.room_id)"
)
_LOWER = (
    "INSERT INTO destinations (destination, last_successful_stream_ordering)"
    " SELECT destination, stream_ordering FROM {staging} WHERE action = 'position'"
    " ON CONFLICT (destination) DO UPDATE"
    " SET last_successful_stream_ordering = excluded.last_successful_stream_ordering"
    " WHERE destinations.last_successful_stream_ordering IS NULL"
    " OR destinations.last_successful_stream_ordering"
    " > excluded.last_successful_stream_ordering"
)


def checked_identifier(name: str) -> str:
    """``name`` if it is a plain SQL identifier (a table or column name to splice into a
    statement), else ValueError."""
    if not _NAME.fullmatch(name):
        raise ValueError(f"not a table or column name: {name!r}")
    return name


async def apply_staged(conn: AsyncConnection, staging: str, high_water_mark: int) -> BatchCounts:
    """Apply the staging table's changes (see the module doc)."""
    name = checked_identifier(staging)
    counts = [
        (await conn.execute(text(q.format(staging=name)), {"hwm": high_water_mark})).rowcount
        for q in (_UPSERT, _DELETE, _LOWER)
    ]
    return BatchCounts(*(max(0, n) for n in counts))


async def apply_changes(
    conn: AsyncConnection, changes: Sequence[StagedChange], high_water_mark: int
) -> BatchCounts:
    """Stage ``changes`` in a temporary table of this connection, then apply them."""
    name = f"batch_changes_{uuid.uuid4().hex[:12]}"
    await conn.execute(text(f"CREATE TEMPORARY TABLE {name} {STAGING_COLUMNS}"))
    try:
        if changes:
            await conn.execute(
                text(f"INSERT INTO {name} VALUES (:d, :r, :s, :a)"),
                [{"d": d, "r": r, "s": s, "a": a} for d, r, s, a in changes],
            )
        return await apply_staged(conn, name, high_water_mark)
    finally:
        await conn.execute(text(f"DROP TABLE {name}"))
