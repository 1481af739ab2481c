"""A server's membership history in ``room_memberships``, for catch-up (native schema).

Catch-up asks whether destination D was in room R at stream position S (the pure
``queue.core.catchup.server_joined_at`` answers it from these rows); the native schema
keeps each member's server in ``server_name``, so only D's rows are read, oldest first.
Synapse's reading of the same history (no server column; made exact at each forward
extremity from state groups) is :mod:`federation_sender.storage.synapse.membership_history`.
"""

from __future__ import annotations

from collections.abc import Collection

from sqlalchemy import bindparam, select
from sqlalchemy.ext.asyncio import AsyncConnection

from federation_sender.model import MembershipRow
from federation_sender.storage.hosts import MEMBERSHIP_COLUMNS, membership_row
from federation_sender.storage.schema import room_memberships as rm

_SERVER_HISTORY = (
    select(rm.c.room_id, *MEMBERSHIP_COLUMNS)
    .where(
        rm.c.room_id.in_(bindparam("rooms", expanding=True)),
        rm.c.server_name == bindparam("server"),
    )
    .order_by(rm.c.event_stream_ordering)
)


async def server_membership_history(
    conn: AsyncConnection, server_name: str, room_ids: Collection[str]
) -> dict[str, list[MembershipRow]]:
    """Membership rows of ``server_name``'s users in each room, oldest first."""
    out: dict[str, list[MembershipRow]] = {r: [] for r in room_ids}
    if not room_ids:
        return out
    res = await conn.execute(
        _SERVER_HISTORY, {"rooms": list(room_ids), "server": server_name}
    )
    for r in res:
        out[str(r[0])].append(membership_row(tuple(r)[1:]))
    return out
