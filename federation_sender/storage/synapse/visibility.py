"""The facts of :mod:`federation_sender.visibility`, read from a Synapse database.

For the events catch-up is about to send to one destination, as Synapse's
``filter_events_for_server`` gathers them:

* erased senders: ``erased_users`` (one row per user deactivated with ``erase: true``);
* partial-state rooms (``partial_state_rooms``), asked only for remote senders;
* the state *after* each event (``event_to_state_groups``, expanded along
  ``state_group_edges`` over ``state_groups_state``, one recursive query for every
  distinct group): its ``m.room.history_visibility`` (the content's value, from
  ``event_json``) and, where that is ``joined`` or ``invited``, the memberships
  (``room_memberships``) of the destination's users, the users whose id's part after
  the first colon is the destination, as Synapse matches them.

An event without a state group (an outlier) reads as ``shared`` with no members, as in
Synapse. A ``history_visibility`` that is not a string (Synapse's sender stops on an
assertion there) reads as ``joined``: withheld unless the destination is joined.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from federation_sender.ids import server_of
from federation_sender.model import EventRow
from federation_sender.visibility import EventFacts

__all__ = ["SynapseVisibility", "visibility_facts"]

_ERASED = text("SELECT user_id FROM erased_users WHERE user_id = ANY(CAST(:users AS TEXT[]))")

_PARTIAL = text(
    "SELECT room_id FROM partial_state_rooms WHERE room_id = ANY(CAST(:rooms AS TEXT[]))"
)

_GROUPS = text(
    "SELECT event_id, state_group FROM event_to_state_groups "
    "WHERE event_id = ANY(CAST(:events AS TEXT[]))"
)

# The nearest row along each group's delta chain of the state selected by ``{where}``.
_CHAIN = """
    WITH RECURSIVE chain(root, sg, depth) AS (
        SELECT g, g, 0 FROM unnest(CAST(:groups AS BIGINT[])) AS g
        UNION ALL
        SELECT c.root, e.prev_state_group, c.depth + 1
        FROM state_group_edges e JOIN chain c ON e.state_group = c.sg
    ),
    picked AS (
        SELECT DISTINCT ON (c.root, s.state_key) c.root, s.event_id
        FROM state_groups_state s JOIN chain c ON s.state_group = c.sg
        WHERE {where}
        ORDER BY c.root, s.state_key, c.depth
    )
"""

_VISIBILITY = text(
    _CHAIN.format(where="s.type = 'm.room.history_visibility' AND s.state_key = ''")
    + "SELECT p.root, j.json FROM picked p JOIN event_json j ON j.event_id = p.event_id"
)

# Asked only for groups whose visibility depends on membership (Synapse skips them
# too): a big room's member rows are many.
_MEMBERS = text(
    _CHAIN.format(
        where="s.type = 'm.room.member' "
        "AND substring(s.state_key FROM '@[^:]*:(.*)$') = :server"
    )
    + "SELECT p.root, r.membership FROM picked p "
    "JOIN room_memberships r ON r.event_id = p.event_id"
)


def _visibility(event_json: object) -> str:
    try:
        content = json.loads(str(event_json)).get("content")
    except (ValueError, AttributeError):
        return "joined"
    if not isinstance(content, dict):
        return "joined"
    value = content.get("history_visibility", "shared")
    return value if isinstance(value, str) else "joined"


async def visibility_facts(
    conn: AsyncConnection, destination: str, server_name: str, events: Sequence[EventRow]
) -> dict[str, EventFacts]:
    """The facts of each event (by event id) for ``destination``; ``server_name`` is ours."""
    if not events:
        return {}
    senders = sorted({e.sender for e in events})
    erased = {str(u) for (u,) in await conn.execute(_ERASED, {"users": senders})}
    remote_rooms = sorted({e.room_id for e in events if server_of(e.sender) != server_name})
    partial: set[str] = set()
    if remote_rooms:
        partial = {str(r) for (r,) in await conn.execute(_PARTIAL, {"rooms": remote_rooms})}
    ids = sorted({e.event_id for e in events})
    group_of = {str(eid): int(g) for eid, g in await conn.execute(_GROUPS, {"events": ids})}
    vis: dict[int, str] = {}
    members: dict[int, list[str]] = {}
    groups = sorted(set(group_of.values()))
    if groups:
        for root, ej in await conn.execute(_VISIBILITY, {"groups": groups}):
            vis[int(root)] = _visibility(ej)
        restricted = [g for g in groups if vis.get(g) in ("joined", "invited")]
        if restricted:
            res = await conn.execute(_MEMBERS, {"groups": restricted, "server": destination})
            for root, membership in res:
                members.setdefault(int(root), []).append(str(membership))
    out: dict[str, EventFacts] = {}
    for e in events:
        g = group_of.get(e.event_id)
        out[e.event_id] = EventFacts(
            sender_erased=e.sender in erased,
            remote_sender_in_partial_state_room=(
                e.room_id in partial and server_of(e.sender) != server_name
            ),
            history_visibility="shared" if g is None else vis.get(g, "shared"),
            memberships=() if g is None else tuple(members.get(g, ())),
            own_membership=(
                e.type == "m.room.member"
                and e.state_key is not None
                and server_of(e.state_key) == destination
            ),
        )
    return out


class SynapseVisibility:
    """Implements :class:`federation_sender.storage.protocols.CatchUpVisibility`."""

    __slots__ = ("_c",)

    def __init__(self, conn: AsyncConnection) -> None:
        self._c = conn

    async def visibility_facts(
        self, destination: str, server_name: str, events: Sequence[EventRow]
    ) -> dict[str, EventFacts]:
        return await visibility_facts(self._c, destination, server_name, events)
