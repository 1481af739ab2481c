"""Persisted stream positions (``stream_positions``): what this worker has processed.

The queue engine keeps two rows per worker instance, keyed by its own instance name:
``federation_sender.events`` (events fanned out) and ``federation_sender.federation``
(federation-stream EDUs queued and acknowledged). The replication client's tokens are
rows ``replication:<reader instance>:<stream>`` keyed by the writer's instance name.
Saving never moves a position backwards, so a late writer cannot undo a newer save.
"""

from __future__ import annotations

from sqlalchemy import bindparam, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from federation_sender import model
from federation_sender.storage.schema import stream_positions


def stored_name(stream: str) -> str:
    """The row name of one of the worker's own logical streams."""
    return "federation_sender." + stream


def replication_prefix(reader: str) -> str:
    return f"replication:{reader}:"


EVENTS_STREAM = stored_name(model.EVENTS_STREAM)
FEDERATION_STREAM = stored_name(model.FEDERATION_STREAM)


async def load_prefixed(conn: AsyncConnection, prefix: str) -> dict[tuple[str, str], int]:
    """(name without ``prefix``, instance) -> position, for the names under ``prefix``."""
    res = await conn.execute(
        select(
            stream_positions.c.stream_name,
            stream_positions.c.instance_name,
            stream_positions.c.stream_id,
        ).where(stream_positions.c.stream_name.startswith(prefix, autoescape=True))
    )
    return {(str(s)[len(prefix) :], str(i)): int(t) for s, i, t in res.all()}


async def load_position(conn: AsyncConnection, stream_name: str, instance_name: str) -> int | None:
    row = (
        await conn.execute(
            select(stream_positions.c.stream_id).where(
                stream_positions.c.stream_name == stream_name,
                stream_positions.c.instance_name == instance_name,
            )
        )
    ).first()
    return None if row is None else int(row[0])


# Built once: saved with every intake batch and every replication position save.
_ADVANCE = (
    update(stream_positions)
    .where(
        stream_positions.c.stream_name == bindparam("name"),
        stream_positions.c.instance_name == bindparam("instance"),
        stream_positions.c.stream_id < bindparam("new_id"),
    )
    .values(stream_id=bindparam("new_id"))
)


async def save_position(
    conn: AsyncConnection, stream_name: str, instance_name: str, stream_id: int
) -> None:
    """Upsert the position; a lower ``stream_id`` than the stored one is ignored."""
    res = await conn.execute(
        _ADVANCE, {"name": stream_name, "instance": instance_name, "new_id": stream_id}
    )
    if res.rowcount:
        return
    existing = await load_position(conn, stream_name, instance_name)
    if existing is None:
        await conn.execute(
            stream_positions.insert().values(
                stream_name=stream_name, instance_name=instance_name, stream_id=stream_id
            )
        )
