"""The catch-up read of ``destination_rooms``, written once for every schema.

:class:`CatchupQuery` pages a destination's rows strictly past a (stream ordering,
room) keyset, oldest first; on Synapse's schema it keeps only rows whose event still
exists (Synapse's ``get_catch_up_room_event_ids``). :class:`CatchUpReads` is one
transaction's :class:`federation_sender.storage.protocols.CatchUpReader`: that query and
the schema's reading of a server's membership history.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection
from typing import Any

from sqlalchemy import Select, Table, and_, bindparam, or_, select
from sqlalchemy.ext.asyncio import AsyncConnection

from federation_sender.model import MembershipRow
from federation_sender.storage.schema import destination_rooms


def _catchup_rows(rooms: Table, keyset: bool, events: Table | None,
                  skip: bool = False) -> Select[Any]:
    past = rooms.c.stream_ordering > bindparam("after")
    if keyset:
        past = or_(
            past,
            and_(
                rooms.c.stream_ordering == bindparam("after"),
                rooms.c.room_id > bindparam("room"),
            ),
        )
    if skip:
        past = and_(past, rooms.c.room_id.not_in(bindparam("skip", expanding=True)))
    q = select(rooms.c.room_id, rooms.c.stream_ordering)
    if events is not None:
        q = q.join(events, events.c.stream_ordering == rooms.c.stream_ordering)
    return (
        q.where(rooms.c.destination == bindparam("dest"), past)
        .order_by(rooms.c.stream_ordering, rooms.c.room_id)
        .limit(bindparam("limit"))
    )


class CatchupQuery:
    """The catch-up read: the ``limit`` oldest (room_id, stream_ordering) rows of
    ``destination_rooms`` past the keyset (``after``, ``after_room``), ordered by
    (stream_ordering, room_id); without ``after_room``, simply past ``after``. With
    ``events``, only rows whose event still exists (Synapse's
    ``get_catch_up_room_event_ids``). With ``skip``, none of those rooms' rows (a
    read beside rooms whose pages await the receiver's confirmation)."""

    def __init__(self, rooms: Table, events: Table | None = None) -> None:
        self._q = {(keyset, skip): _catchup_rows(rooms, keyset, events, skip)
                   for keyset in (False, True) for skip in (False, True)}

    async def rows(
        self, conn: AsyncConnection, destination: str, after: int, limit: int,
        after_room: str | None = None, skip: Collection[str] = (),
    ) -> list[tuple[str, int]]:
        params: dict[str, object] = {"dest": destination, "after": after, "limit": limit}
        if after_room is not None:
            params["room"] = after_room
        if skip:
            params["skip"] = sorted(skip)
        res = await conn.execute(self._q[after_room is not None, bool(skip)], params)
        return [(str(r[0]), int(r[1])) for r in res]


CATCHUP = CatchupQuery(destination_rooms)
catchup_rows = CATCHUP.rows

MembershipHistory = Callable[
    [AsyncConnection, str, Collection[str]], Awaitable[dict[str, list[MembershipRow]]]
]


class CatchUpReads:
    """Implements :class:`federation_sender.storage.protocols.CatchUpReader`: a schema's
    catch-up query and its reading of a server's membership history."""

    __slots__ = ("_c", "_history", "_q")

    def __init__(
        self, conn: AsyncConnection, query: CatchupQuery, history: MembershipHistory
    ) -> None:
        self._c = conn
        self._q = query
        self._history = history

    async def catchup_rows(
        self, destination: str, after: int, limit: int, after_room: str | None = None,
        skip: Collection[str] = (),
    ) -> list[tuple[str, int]]:
        return await self._q.rows(self._c, destination, after, limit, after_room, skip)

    async def server_membership_history(
        self, server_name: str, room_ids: Collection[str]
    ) -> dict[str, list[MembershipRow]]:
        return await self._history(self._c, server_name, room_ids)
