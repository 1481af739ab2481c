"""Device-list updates in the native ``device_lists_outbound_pokes``, the pair of
:mod:`.synapse.device_lists`.

One ``m.device_list_update`` per row: the EDU's content is ``content_json`` plus the
row's ``user_id``, ``device_id`` and ``stream_id`` (the simulator writes whole EDUs;
Synapse's side builds them from its device and key tables). ``sent`` is set once the
destination answered 200, so a crash re-sends the row; Synapse deletes delivered pokes.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from sqlalchemy import Select, and_, bindparam, literal, select, true, tuple_, update
from sqlalchemy.ext.asyncio import AsyncConnection

from federation_sender.storage.schema import device_lists_outbound_pokes as dlp


def unsent_select() -> Select[Any]:
    """Unsent rows of ``:dest`` past ``:dl_after``, at most ``:limit``, in stream order,
    as ``(kind 1, stream_id, user_id, device_id, content_json)``
    (see :func:`.to_device.unsent_select`)."""
    return (
        select(
            literal(1).label("kind"),
            dlp.c.stream_id,
            dlp.c.user_id,
            dlp.c.device_id,
            dlp.c.content_json.label("body"),
        )
        .where(
            dlp.c.destination == bindparam("dest"),
            dlp.c.sent.is_(False),
            dlp.c.stream_id > bindparam("dl_after"),
        )
        .order_by(dlp.c.stream_id, dlp.c.user_id, dlp.c.device_id)
        .limit(bindparam("limit"))
    )


def destinations_with_pokes(names: Collection[str]) -> Select[Any]:
    """Those of ``names`` with an unsent row."""
    return select(dlp.c.destination).where(
        dlp.c.destination.in_(sorted(names)), dlp.c.sent.is_(False)
    )


async def destinations_for_users(conn: AsyncConnection, user_ids: Collection[str]) -> list[str]:
    """Destinations with unsent rows for these users."""
    if not user_ids:
        return []
    res = await conn.execute(
        select(dlp.c.destination)
        .where(dlp.c.user_id.in_(sorted(user_ids)), dlp.c.sent.is_(False))
        .distinct()
    )
    return [str(d) for d in res.scalars()]


async def mark_sent(
    conn: AsyncConnection, destination: str, keys: Collection[tuple[int, str, str]]
) -> None:
    """The destination answered 200 for these rows, keyed (stream_id, user_id, device_id)."""
    if not keys:
        return
    await conn.execute(
        update(dlp)
        .where(
            and_(
                dlp.c.destination == destination,
                tuple_(dlp.c.stream_id, dlp.c.user_id, dlp.c.device_id).in_(sorted(keys)),
            )
        )
        .values(sent=true())
    )
