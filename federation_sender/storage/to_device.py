"""To-device messages in the native ``device_federation_outbox``, the pair of
:mod:`.synapse.to_device`.

One row per ``m.direct_to_device`` EDU (``messages_json`` is its content), read per
destination past a stream id; ``sent_ts`` is set once the destination answered 200, so
a crash re-sends the row (its ``message_id`` lets the receiver deduplicate). Synapse's
table has no ``sent_ts``: there a delivered row is deleted.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from sqlalchemy import Select, bindparam, literal, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from federation_sender.storage.schema import device_federation_outbox as tdo


def unsent_select() -> Select[Any]:
    """Unsent rows of ``:dest`` past ``:td_after``, at most ``:limit``, in stream order,
    as ``(kind 0, stream_id, '', '', messages_json)``: the shape the backend's one-trip
    read of both outboxes unions with :func:`.device_lists.unsent_select`."""
    return (
        select(
            literal(0).label("kind"),
            tdo.c.stream_id,
            literal("").label("user_id"),
            literal("").label("device_id"),
            tdo.c.messages_json.label("body"),
        )
        .where(
            tdo.c.destination == bindparam("dest"),
            tdo.c.stream_id > bindparam("td_after"),
            tdo.c.sent_ts.is_(None),
        )
        .order_by(tdo.c.stream_id)
        .limit(bindparam("limit"))
    )


def destinations_with_rows(names: Collection[str]) -> Select[Any]:
    """Those of ``names`` with an unsent row."""
    return select(tdo.c.destination).where(
        tdo.c.destination.in_(sorted(names)), tdo.c.sent_ts.is_(None)
    )


async def mark_sent(
    conn: AsyncConnection, destination: str, stream_ids: Collection[int], now_ms: int
) -> None:
    """The destination answered 200 for these rows."""
    if not stream_ids:
        return
    await conn.execute(
        update(tdo)
        .where(tdo.c.destination == destination, tdo.c.stream_id.in_(sorted(stream_ids)))
        .values(sent_ts=now_ms)
    )
