"""How the main process writes our schema: the one copy of the rows it inserts.

Both stand-ins for the main process use it: the simulator's store
(:class:`federation_sender.sim.store.SimStore`, whole batches of a simulated world) and
the queue tests' writer (:class:`federation_sender.testing.queue_writer.HomeserverWriter`,
one event at a time). Row builders are pure; :func:`write_main_rows` is the one write
both make, inside the caller's transaction; they differ only in how they allocate stream
ids (the simulator reserves them from its publisher, the queue writer counts locally).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, TypeVar

from sqlalchemy import Table, delete, insert
from sqlalchemy.ext.asyncio import AsyncConnection

from federation_sender.ids import server_of
from federation_sender.storage import schema

T = TypeVar("T")
CHUNK = 500
Row = dict[str, Any]


def chunks(items: Sequence[T], n: int = CHUNK) -> Iterator[Sequence[T]]:
    for i in range(0, len(items), n):
        yield items[i : i + n]


def compact(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def event_row(
    stream_ordering: int,
    event_id: str,
    pdu: Mapping[str, Any],
    *,
    outlier: bool = False,
    instance_name: str | None = None,
) -> Row:
    """An ``events`` row for ``pdu``; ``event_id`` is given because a PDU of a modern
    room version does not carry its own (it is the reference hash)."""
    row: Row = {
        "stream_ordering": stream_ordering,
        "event_id": event_id,
        "room_id": pdu["room_id"],
        "type": pdu["type"],
        "state_key": pdu.get("state_key"),
        "sender": pdu["sender"],
        "origin_server_ts": pdu["origin_server_ts"],
        "outlier": outlier,
        "rejected": False,
        "json": compact(pdu),
    }
    if instance_name is not None:
        row["instance_name"] = instance_name
    return row


def membership_row(
    event_id: str, stream_ordering: int, room_id: str, user_id: str, sender: str, membership: str
) -> Row:
    """A ``room_memberships`` row: the member's server is the user id's."""
    return {
        "event_id": event_id,
        "event_stream_ordering": stream_ordering,
        "room_id": room_id,
        "user_id": user_id,
        "server_name": server_of(user_id),
        "sender": sender,
        "membership": membership,
    }


def outbox_row(destination: str, stream_id: int, queued_ts: int, content: Any) -> Row:
    """A ``device_federation_outbox`` row (a to-device message for ``destination``)."""
    return {
        "destination": destination,
        "stream_id": stream_id,
        "queued_ts": queued_ts,
        "messages_json": compact(content),
        "sent_ts": None,
    }


def poke_row(
    destination: str, stream_id: int, user_id: str, device_id: str, ts: int, content: Any
) -> Row:
    """A ``device_lists_outbound_pokes`` row (a device change to tell ``destination``)."""
    return {
        "destination": destination,
        "stream_id": stream_id,
        "user_id": user_id,
        "device_id": device_id,
        "ts": ts,
        "content_json": compact(content),
        "sent": False,
    }


async def insert_rows(conn: AsyncConnection, table: Table, rows: Sequence[Row]) -> None:
    for chunk in chunks(rows):
        await conn.execute(insert(table), list(chunk))


async def replace_extremities(
    conn: AsyncConnection, extremities: Mapping[str, Sequence[str]]
) -> None:
    """Each room's forward extremities become exactly the given event ids."""
    if not extremities:
        return
    fx = schema.event_forward_extremities
    rooms = sorted(extremities)
    for chunk in chunks(rooms):
        await conn.execute(delete(fx).where(fx.c.room_id.in_(chunk)))
    rows = [{"event_id": e, "room_id": r} for r in rooms for e in extremities[r]]
    await insert_rows(conn, fx, rows)


async def write_main_rows(
    conn: AsyncConnection,
    *,
    events: Sequence[Row] = (),
    memberships: Sequence[Row] = (),
    extremities: Mapping[str, Sequence[str]] | None = None,
    to_device: Sequence[Row] = (),
    pokes: Sequence[Row] = (),
) -> None:
    """Everything a batch of the main process writes, in one transaction (the caller's):
    events, their membership rows, each room's new forward extremities, to-device outbox
    rows and device-list pokes."""
    await insert_rows(conn, schema.events, events)
    await insert_rows(conn, schema.room_memberships, memberships)
    await replace_extremities(conn, extremities or {})
    await insert_rows(conn, schema.device_federation_outbox, to_device)
    await insert_rows(conn, schema.device_lists_outbound_pokes, pokes)
