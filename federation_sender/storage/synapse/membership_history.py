"""A server's membership history in Synapse's tables, for catch-up (the native
schema's is :mod:`federation_sender.storage.membership_history`).

(The catch-up rows themselves, Synapse's ``get_catch_up_room_event_ids``, are the shared
:class:`federation_sender.storage.catchup.CatchupQuery` joined with ``events``,
:data:`.destinations.CATCHUP`.) A
destination's membership history is read from ``room_memberships`` (Synapse
has no server column: the server is the part of the user id after the first colon),
ordered by stream position; rows without one (outliers of a room joined over
federation) are placed at the position they were persisted at. At each forward
extremity the history is made exact from the extremity's state group, so whether the
destination may see an extremity is Synapse's question: was it joined in the state
after the extremity.
"""

from __future__ import annotations

from collections.abc import Collection

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from federation_sender.model import MembershipRow

_SERVER_HISTORY = text(
    """
    SELECT m.room_id, COALESCE(m.event_stream_ordering, e.stream_ordering), m.user_id,
           m.membership
    FROM room_memberships m LEFT JOIN events e ON e.event_id = m.event_id
    WHERE m.room_id = ANY(CAST(:rooms AS TEXT[]))
      AND substring(m.user_id FROM '@[^:]*:(.*)$') = :server
      AND COALESCE(m.event_stream_ordering, e.stream_ordering) IS NOT NULL
    ORDER BY 2
    """
)


# The destination's members in the state after each forward extremity of the rooms.
_AT_EXTREMITIES = text(
    """
    WITH RECURSIVE ext AS (
        SELECT f.room_id, e.stream_ordering, s.state_group
        FROM event_forward_extremities f
        JOIN events e ON e.event_id = f.event_id
        JOIN event_to_state_groups s ON s.event_id = f.event_id
        WHERE f.room_id = ANY(CAST(:rooms AS TEXT[])) AND e.stream_ordering IS NOT NULL
    ), chain(root, sg, depth) AS (
        SELECT DISTINCT state_group, state_group, 0 FROM ext
        UNION ALL
        SELECT c.root, g.prev_state_group, c.depth + 1
        FROM state_group_edges g JOIN chain c ON g.state_group = c.sg
    ), members AS (
        SELECT DISTINCT ON (c.root, s.state_key) c.root, s.state_key, s.event_id
        FROM state_groups_state s JOIN chain c ON s.state_group = c.sg
        WHERE s.type = 'm.room.member'
          AND substring(s.state_key FROM '@[^:]*:(.*)$') = :server
        ORDER BY c.root, s.state_key, c.depth
    )
    SELECT x.room_id, x.stream_ordering, m.state_key, r.membership
    FROM ext x JOIN members m ON m.root = x.state_group
    JOIN room_memberships r ON r.event_id = m.event_id
    """
)


async def server_membership_history(
    conn: AsyncConnection, server_name: str, room_ids: Collection[str]
) -> dict[str, list[MembershipRow]]:
    """The server's membership rows in stream order, made exact at each forward
    extremity: there, every one of its users gets the membership it has in the state
    after the extremity (``leave`` when it is not in that state), so "was the server
    joined at the extremity" is Synapse's question, answered from state groups."""
    out: dict[str, list[MembershipRow]] = {r: [] for r in room_ids}
    if not room_ids:
        return out
    rooms = list(room_ids)
    res = await conn.execute(_SERVER_HISTORY, {"rooms": rooms, "server": server_name})
    for room, so, user, membership in res:
        out[str(room)].append(MembershipRow(int(so), str(user), server_name, str(membership)))
    at: dict[tuple[str, int], dict[str, str]] = {}
    for room, so, user, membership in await conn.execute(
        _AT_EXTREMITIES, {"rooms": rooms, "server": server_name}
    ):
        at.setdefault((str(room), int(so)), {})[str(user)] = str(membership)
    for (room, so), state in at.items():
        rows = out[room]
        users = {r.user_id for r in rows if r.stream_ordering <= so} | set(state)
        rows.extend(
            MembershipRow(so, u, server_name, state.get(u, "leave")) for u in sorted(users)
        )
        # Stable: at one position the state's rows come after the real ones.
        rows.sort(key=_position)
    return out


def _position(row: MembershipRow) -> int:
    return row.stream_ordering
