"""Which servers are in a room at a stream position (``room_memberships``).

"Servers in room R at stream position S": for each user of R, the latest membership row
with ``event_stream_ordering <= S``; a server is in the room if any of its users' latest
row is ``join``.

The fan-out asks this once per event, always at increasing positions per room, so
:class:`RoomHostsCache` keeps, per room, the membership state at the last position it
reached and rolls it forward with the rows in between (one query per batch of events
for all rooms in the batch). Positions behind the cached one fall back to replaying the
room's history from the database. Catch-up asks the reverse question (was server D in
the room at position S) through :mod:`.membership_history`, which reads only D's rows
(the answer is computed by the pure ``queue.core.catchup.server_joined_at``).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from sqlalchemy import bindparam, select
from sqlalchemy.ext.asyncio import AsyncConnection

from federation_sender.ids import server_of
from federation_sender.model import EventRow, MembershipRow
from federation_sender.storage.schema import room_memberships as rm


def leaving_server(event: EventRow) -> str | None:
    """The target's server of a leave or ban (it receives its own kick or leave)."""
    if event.type != "m.room.member" or not event.state_key:
        return None
    try:
        membership = json.loads(event.json).get("content", {}).get("membership")
    except ValueError:
        membership = None
    return server_of(event.state_key) if membership in ("leave", "ban") else None


@dataclass(slots=True)
class MembershipState:
    """Membership of one room at ``position``; pure, rolled forward by :meth:`apply`."""

    position: int = -1
    users: dict[str, tuple[str, str]] = field(default_factory=dict)
    """user_id -> (server_name, membership)"""
    joined_count: dict[str, int] = field(default_factory=dict)
    _snapshot: frozenset[str] | None = None

    def apply(self, row: MembershipRow) -> None:
        prev = self.users.get(row.user_id)
        if prev is not None and prev[1] == "join":
            n = self.joined_count[prev[0]] - 1
            if n:
                self.joined_count[prev[0]] = n
            else:
                del self.joined_count[prev[0]]
        self.users[row.user_id] = (row.server_name, row.membership)
        if row.membership == "join":
            self.joined_count[row.server_name] = self.joined_count.get(row.server_name, 0) + 1
        self.position = max(self.position, row.stream_ordering)
        self._snapshot = None

    def joined_servers(self) -> frozenset[str]:
        if self._snapshot is None:
            self._snapshot = frozenset(self.joined_count)
        return self._snapshot


def membership_row(r: Sequence[object]) -> MembershipRow:
    """A row of :data:`MEMBERSHIP_COLUMNS` as a :class:`MembershipRow`."""
    return MembershipRow(int(r[0]), str(r[1]), str(r[2]), str(r[3]))  # type: ignore[call-overload]


MEMBERSHIP_COLUMNS = (
    rm.c.event_stream_ordering, rm.c.user_id, rm.c.server_name, rm.c.membership
)
"""The columns of a :class:`MembershipRow` (this module's reads and
:mod:`.membership_history`'s)."""


# Built once (the intake reads this for every batch): constructing a statement and its
# cache key costs more than executing a cached one.
_ROWS = (
    select(rm.c.room_id, *MEMBERSHIP_COLUMNS)
    .where(
        rm.c.room_id.in_(bindparam("rooms", expanding=True)),
        rm.c.event_stream_ordering > bindparam("after"),
        rm.c.event_stream_ordering <= bindparam("upto"),
    )
    .order_by(rm.c.event_stream_ordering)
)


async def _rows(
    conn: AsyncConnection, room_ids: Collection[str], after: int, upto: int
) -> dict[str, list[MembershipRow]]:
    out: dict[str, list[MembershipRow]] = {r: [] for r in room_ids}
    if not room_ids:
        return out
    res = await conn.execute(_ROWS, {"rooms": list(room_ids), "after": after, "upto": upto})
    for r in res:
        out[str(r[0])].append(membership_row(tuple(r)[1:]))
    return out


async def joined_servers_at(conn: AsyncConnection, room_id: str, position: int) -> frozenset[str]:
    """Uncached answer, replaying the room's history up to ``position``."""
    state = MembershipState()
    for row in (await _rows(conn, [room_id], -1, position))[room_id]:
        state.apply(row)
    return state.joined_servers()


class RoomHostsCache:
    """Per-room membership state rolled forward with the fan-out; LRU-bounded."""

    def __init__(self, max_rooms: int = 10_000) -> None:
        self._max_rooms = max_rooms
        self._rooms: OrderedDict[str, MembershipState] = OrderedDict()
        self.hits = 0
        self.misses = 0

    async def hosts_for_events(
        self, conn: AsyncConnection, positions: Mapping[str, Sequence[int]]
    ) -> dict[str, list[frozenset[str]]]:
        """For each room, the joined servers *after* each of the given positions
        (ascending per room). At most two queries whatever the number of rooms."""
        cached: dict[str, int] = {}
        fresh: list[str] = []
        out: dict[str, list[frozenset[str]]] = {}
        for room, sos in positions.items():
            if not sos:
                out[room] = []
                continue
            st = self._rooms.get(room)
            if st is not None and st.position <= sos[0]:
                cached[room] = st.position
                self._rooms.move_to_end(room)
                self.hits += 1
            else:
                fresh.append(room)
                self.misses += 1
        upto = max((sos[-1] for sos in positions.values() if sos), default=-1)
        new_rows: dict[str, list[MembershipRow]] = {}
        if cached:
            new_rows.update(await _rows(conn, list(cached), min(cached.values()), upto))
        if fresh:
            new_rows.update(await _rows(conn, fresh, -1, upto))
        for room, sos in positions.items():
            if not sos:
                continue
            st = self._rooms.get(room) if room in cached else MembershipState()
            assert st is not None
            rows = [r for r in new_rows.get(room, ()) if r.stream_ordering > st.position]
            answers: list[frozenset[str]] = []
            i = 0
            for so in sos:
                while i < len(rows) and rows[i].stream_ordering <= so:
                    st.apply(rows[i])
                    i += 1
                answers.append(st.joined_servers())
            st.position = max(st.position, sos[-1])
            # Rows past the last asked position stay unapplied; the state stays valid at
            # ``sos[-1]`` because rows are only applied up to it.
            out[room] = answers
            self._remember(room, st)
        return out

    def _remember(self, room: str, st: MembershipState) -> None:
        self._rooms[room] = st
        self._rooms.move_to_end(room)
        while len(self._rooms) > self._max_rooms:
            self._rooms.popitem(last=False)

    def __len__(self) -> int:
        return len(self._rooms)

