"""Rooms, hosts and presence states from Synapse's tables, for the ephemeral EDUs.

* current hosts: ``get_current_hosts_in_room`` (joined members in
  ``current_state_events``, the server part of the state key); for receipts, in a
  partial-state room, also the servers at our join (``partial_state_rooms_servers``);
* an event's sender and ``received_ts`` (``get_metadata_for_event``), for the receipt
  pacing rule;
* a user's rooms: ``get_rooms_for_user`` (their joins in ``current_state_events``);
* presence: ``presence_stream`` (Synapse keeps the latest row per user), the non-offline
  states at start as ``take_presence_startup_info`` reads them.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from federation_sender.edus import EventMeta
from federation_sender.replication.rows import PresenceState

_HOSTS = text(
    "SELECT DISTINCT substring(state_key FROM '@[^:]*:(.*)$') FROM current_state_events"
    " WHERE room_id = :room AND type = 'm.room.member' AND membership = 'join'"
)
_SERVERS_AT_JOIN = text(
    "SELECT server_name FROM partial_state_rooms_servers WHERE room_id = :room"
)
_EVENT_META = text(
    "SELECT sender, received_ts FROM events WHERE event_id = :event AND room_id = :room"
)
_ROOMS = text(
    "SELECT room_id FROM current_state_events"
    " WHERE type = 'm.room.member' AND state_key = :user AND membership = 'join'"
)
_PRESENCE = (
    "SELECT DISTINCT ON (user_id) user_id, state, last_active_ts, last_federation_update_ts,"
    " last_user_sync_ts, status_msg, currently_active FROM presence_stream WHERE {where}"
    " ORDER BY user_id, stream_id DESC"
)
_STARTUP = text(_PRESENCE.format(where="state != 'offline'"))
_FOR_USERS = text(_PRESENCE.format(where="user_id = ANY(:users)"))


def _state(r: Any) -> PresenceState:
    return PresenceState(
        str(r[0]), str(r[1]), int(r[2] or 0), int(r[3] or 0), int(r[4] or 0),
        None if r[5] is None else str(r[5]), bool(r[6]),
    )


class SynapseRooms:
    """Implements :class:`federation_sender.edus.presence.PresenceSource` and
    :class:`federation_sender.edus.RoomHosts` on Synapse's tables."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine

    async def startup_states(self) -> list[PresenceState]:
        async with self._engine.connect() as conn:
            return [_state(r) for r in await conn.execute(_STARTUP)]

    async def states_for_users(self, user_ids: Collection[str]) -> dict[str, PresenceState]:
        async with self._engine.connect() as conn:
            rows = await conn.execute(_FOR_USERS, {"users": list(user_ids)})
            return {s.user_id: s for s in map(_state, rows)}

    async def rooms_for_user(self, user_id: str) -> list[str]:
        async with self._engine.connect() as conn:
            return [str(r[0]) for r in await conn.execute(_ROOMS, {"user": user_id})]

    async def current_hosts(self, room_id: str) -> frozenset[str]:
        async with self._engine.connect() as conn:
            return frozenset(str(r[0]) for r in await conn.execute(_HOSTS, {"room": room_id})
                             if r[0])

    async def receipt_hosts(self, room_id: str) -> frozenset[str]:
        async with self._engine.connect() as conn:
            at_join = {str(r[0]) for r in await conn.execute(_SERVERS_AT_JOIN, {"room": room_id})}
            now = {str(r[0]) for r in await conn.execute(_HOSTS, {"room": room_id}) if r[0]}
        return frozenset(at_join | now)

    async def event_meta(self, room_id: str, event_id: str) -> EventMeta | None:
        async with self._engine.connect() as conn:
            row = (await conn.execute(_EVENT_META, {"event": event_id, "room": room_id})).first()
        return None if row is None else EventMeta(str(row[0]), int(row[1] or 0))
