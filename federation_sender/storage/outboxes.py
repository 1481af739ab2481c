"""The durable EDU outboxes, read per destination by stream id.

* ``device_federation_outbox``: one to-device EDU per row (``messages_json`` is the EDU
  content of an ``m.direct_to_device`` EDU); ``sent_ts`` is set once delivered.
* ``device_lists_outbound_pokes``: one ``m.device_list_update`` per row (content from
  ``content_json`` plus ``user_id``, ``device_id`` and ``stream_id``); ``sent`` is set once
  delivered.

Rows are only marked sent after the remote answered 200, so a crash re-sends them
(to-device messages carry ``message_id`` for the receiver to deduplicate).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from sqlalchemy import (
    Select,
    and_,
    bindparam,
    literal,
    select,
    true,
    tuple_,
    union,
    union_all,
    update,
)
from sqlalchemy.ext.asyncio import AsyncConnection

from federation_sender.model import DeviceListRow, ToDeviceRow
from federation_sender.storage.schema import device_federation_outbox as tdo
from federation_sender.storage.schema import device_lists_outbound_pokes as dlp


async def unsent_to_device(
    conn: AsyncConnection, destination: str, after: int, limit: int
) -> list[ToDeviceRow]:
    res = await conn.execute(
        select(tdo.c.stream_id, tdo.c.messages_json)
        .where(
            tdo.c.destination == destination,
            tdo.c.stream_id > after,
            tdo.c.sent_ts.is_(None),
        )
        .order_by(tdo.c.stream_id)
        .limit(limit)
    )
    return [ToDeviceRow(int(r[0]), str(r[1])) for r in res]


async def unsent_device_lists(
    conn: AsyncConnection, destination: str, after: int, limit: int
) -> list[DeviceListRow]:
    res = await conn.execute(
        select(dlp.c.stream_id, dlp.c.user_id, dlp.c.device_id, dlp.c.content_json)
        .where(
            dlp.c.destination == destination,
            dlp.c.sent.is_(False),
            dlp.c.stream_id > after,
        )
        .order_by(dlp.c.stream_id, dlp.c.user_id, dlp.c.device_id)
        .limit(limit)
    )
    return [DeviceListRow(int(r[0]), str(r[1]), str(r[2]), str(r[3])) for r in res]


def _build_unsent_outbox() -> Select[Any]:
    a = (
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
    b = (
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
    u = union_all(select(a.subquery()), select(b.subquery())).subquery()
    return select(u).order_by(u.c.kind, u.c.stream_id, u.c.user_id, u.c.device_id)


_UNSENT_OUTBOX = _build_unsent_outbox()


async def unsent_outbox(
    conn: AsyncConnection,
    destination: str,
    to_device_after: int,
    device_lists_after: int,
    limit: int,
) -> tuple[list[ToDeviceRow], list[DeviceListRow]]:
    """Both outboxes in one round trip (``UNION ALL``); most destinations have none."""
    res = await conn.execute(
        _UNSENT_OUTBOX,
        {
            "dest": destination,
            "td_after": to_device_after,
            "dl_after": device_lists_after,
            "limit": limit,
        },
    )
    td: list[ToDeviceRow] = []
    dl: list[DeviceListRow] = []
    for kind, sid, user, device, body in res:
        if kind == 0:
            td.append(ToDeviceRow(int(sid), str(body)))
        else:
            dl.append(DeviceListRow(int(sid), str(user), str(device), str(body)))
    return td, dl


async def mark_to_device_sent(
    conn: AsyncConnection, destination: str, stream_ids: Collection[int], now_ms: int
) -> None:
    if not stream_ids:
        return
    await conn.execute(
        update(tdo)
        .where(tdo.c.destination == destination, tdo.c.stream_id.in_(sorted(stream_ids)))
        .values(sent_ts=now_ms)
    )


async def mark_device_lists_sent(
    conn: AsyncConnection, destination: str, keys: Collection[tuple[int, str, str]]
) -> None:
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


async def has_unsent(conn: AsyncConnection, destination: str) -> bool:
    a = (
        await conn.execute(
            select(tdo.c.stream_id)
            .where(tdo.c.destination == destination, tdo.c.sent_ts.is_(None))
            .limit(1)
        )
    ).first()
    if a is not None:
        return True
    b = (
        await conn.execute(
            select(dlp.c.stream_id)
            .where(dlp.c.destination == destination, dlp.c.sent.is_(False))
            .limit(1)
        )
    ).first()
    return b is not None


async def device_list_destinations(conn: AsyncConnection, user_ids: Collection[str]) -> list[str]:
    """Destinations with unsent device-list rows for these users."""
    if not user_ids:
        return []
    res = await conn.execute(
        select(dlp.c.destination)
        .where(dlp.c.user_id.in_(sorted(user_ids)), dlp.c.sent.is_(False))
        .distinct()
    )
    return [str(d) for d in res.scalars()]


async def destinations_with_unsent(
    conn: AsyncConnection, destinations: Collection[str]
) -> set[str]:
    """Those of ``destinations`` with an unsent row in either outbox (one statement)."""
    if not destinations:
        return set()
    names = sorted(destinations)
    a = select(tdo.c.destination).where(tdo.c.destination.in_(names), tdo.c.sent_ts.is_(None))
    b = select(dlp.c.destination).where(dlp.c.destination.in_(names), dlp.c.sent.is_(False))
    return {str(r) for r in (await conn.execute(union(a, b))).scalars()}
