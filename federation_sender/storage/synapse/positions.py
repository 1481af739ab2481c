"""Positions on Synapse's database: ``federation_stream_position`` and the replication
client's tokens.

* ``federation_stream_position``: our ``events`` and ``federation`` rows, never moved
  backwards. At first use the table is made to match ``federation_sender_instances``
  exactly as Synapse's worker does at start (``_reset_federation_positions_txn``: the
  minimum position of each type is given to each configured instance, other instances'
  rows are deleted), so a handover from Synapse's worker (or from main, or a changed
  instance list) resends rather than drops.
* ``replication_positions`` (our own schema): the replication client's tokens, keyed by
  ``<reader>:<stream>`` and the writer instance, never moved backwards.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import select, text
from sqlalchemy.ext.asyncio import AsyncConnection

from federation_sender.storage.synapse.schema import federation_stream_position


async def reset_federation_positions(
    conn: AsyncConnection, instance: str, configured: Sequence[str]
) -> dict[str, int]:
    """Synapse's ``_reset_federation_positions_txn``, for our instance. Returns, per
    type, our own position before the reset where the reset moved it back (a changed
    instance list gave us the minimum of a slower instance's): what we had already
    handed to our own destinations (:attr:`federation_sender.queue.fanout.EventFanout.
    replay_upto`)."""
    t = federation_stream_position
    instances = configured or [instance]
    if instance not in instances:
        return {}
    rows = [(str(i), str(k), int(v)) for i, k, v in
            await conn.execute(select(t.c.instance_name, t.c.type, t.c.stream_id))]
    present = {i for i, _, _ in rows}
    if present == set(instances) or not present:
        return {}
    mins: dict[str, int] = {}
    for _, typ, stream_id in rows:
        mins[typ] = min(mins.get(typ, stream_id), stream_id)
    own = {typ: stream_id for i, typ, stream_id in rows if i == instance}
    await conn.execute(t.delete().where(t.c.instance_name.not_in(list(instances))))
    for typ, stream_id in mins.items():
        await save_position(conn, typ, instance, stream_id, monotonic=False)
    return {typ: own[typ] for typ in mins if own.get(typ, mins[typ]) > mins[typ]}


async def load_position(conn: AsyncConnection, typ: str, instance: str) -> int | None:
    t = federation_stream_position
    v = (
        await conn.execute(
            select(t.c.stream_id).where(t.c.type == typ, t.c.instance_name == instance)
        )
    ).scalar()
    return None if v is None else int(v)


async def save_position(
    conn: AsyncConnection, typ: str, instance: str, stream_id: int, *, monotonic: bool = True
) -> None:
    t = federation_stream_position
    stmt = t.update().where(t.c.type == typ, t.c.instance_name == instance)
    if monotonic:
        stmt = stmt.where(t.c.stream_id < stream_id)
    res = await conn.execute(stmt.values(stream_id=stream_id))
    if res.rowcount:
        return
    if await load_position(conn, typ, instance) is None:
        await conn.execute(
            t.insert().values(type=typ, instance_name=instance, stream_id=stream_id)
        )


_LOAD_REPLICATION = text(
    "SELECT stream_name, instance_name, stream_id FROM replication_positions "
    "WHERE stream_name LIKE :prefix"
)
_SAVE_REPLICATION = text(
    """
    INSERT INTO replication_positions (stream_name, instance_name, stream_id)
    VALUES (:s, :i, :v)
    ON CONFLICT (stream_name, instance_name) DO UPDATE SET stream_id = EXCLUDED.stream_id
    WHERE replication_positions.stream_id < EXCLUDED.stream_id
    """
)


def _prefix(reader: str) -> str:
    return f"{reader}:"


async def load_replication(conn: AsyncConnection, reader: str) -> dict[tuple[str, str], int]:
    p = _prefix(reader)
    like = p.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
    res = await conn.execute(_LOAD_REPLICATION, {"prefix": like})
    return {(str(s)[len(p) :], str(i)): int(v) for s, i, v in res}


async def save_replication(
    conn: AsyncConnection, reader: str, stream: str, writer: str, token: int
) -> None:
    await conn.execute(_SAVE_REPLICATION, {"s": _prefix(reader) + stream, "i": writer, "v": token})

