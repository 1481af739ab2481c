"""The ``edu_rooms`` capability on Synapse's tables: rooms, hosts, event metadata and
presence states for the ephemeral EDUs (the Protocols are
:class:`federation_sender.storage.capabilities.EduRooms`'s; the native backend offers
none).

* current hosts: ``get_current_hosts_in_room`` (:func:`.hosts.current_hosts`); for
  receipts, in a partial-state room, also the servers at our join
  (:func:`.hosts.partial_state_servers`);
* an event's sender and ``received_ts`` (``get_metadata_for_event``,
  :func:`.events.sender_and_received_ts`), for the receipt pacing rule;
* a user's rooms: ``get_rooms_for_user`` (their joins in ``current_state_events``);
* presence: ``presence_stream`` (Synapse keeps the latest row per user), the non-offline
  states at start as ``take_presence_startup_info`` reads them.

:class:`EduRoomReads` runs them on one connection; :class:`SynapseEduRooms` runs each
read in a transaction of the backend (:meth:`SynapseBackend.read_rooms`), which offers it
as its ``edu_rooms`` capability.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection
from typing import Any, Protocol, TypeVar

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from federation_sender.replication.rows import PresenceState
from federation_sender.storage.protocols import EventMeta
from federation_sender.storage.synapse.events import sender_and_received_ts
from federation_sender.storage.synapse.hosts import current_hosts, partial_state_servers

T = TypeVar("T")

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


class EduRoomReads:
    """The EDU fan-outs' reads on one connection."""

    __slots__ = ("_c",)

    def __init__(self, conn: AsyncConnection) -> None:
        self._c = conn

    async def startup_states(self) -> list[PresenceState]:
        return [_state(r) for r in await self._c.execute(_STARTUP)]

    async def states_for_users(self, user_ids: Collection[str]) -> dict[str, PresenceState]:
        rows = await self._c.execute(_FOR_USERS, {"users": list(user_ids)})
        return {s.user_id: s for s in map(_state, rows)}

    async def rooms_for_user(self, user_id: str) -> list[str]:
        return [str(r[0]) for r in await self._c.execute(_ROOMS, {"user": user_id})]

    async def current_hosts(self, room_id: str) -> frozenset[str]:
        return (await current_hosts(self._c, [room_id]))[room_id]

    async def receipt_hosts(self, room_id: str) -> frozenset[str]:
        at_join = (await partial_state_servers(self._c, [room_id])).get(room_id, frozenset())
        return at_join | await self.current_hosts(room_id)

    async def event_meta(self, room_id: str, event_id: str) -> EventMeta | None:
        found = await sender_and_received_ts(self._c, room_id, event_id)
        return None if found is None else EventMeta(*found)


class EduRoomReader(Protocol):
    async def read_rooms(self, fn: Callable[[EduRoomReads], Awaitable[T]]) -> T: ...


class SynapseEduRooms:
    """Implements :class:`federation_sender.storage.capabilities.EduRooms` on Synapse's
    tables, each read in a transaction of the backend."""

    def __init__(self, backend: EduRoomReader) -> None:
        self._b = backend

    async def startup_states(self) -> list[PresenceState]:
        return await self._b.read_rooms(lambda r: r.startup_states())

    async def states_for_users(self, user_ids: Collection[str]) -> dict[str, PresenceState]:
        return await self._b.read_rooms(lambda r: r.states_for_users(user_ids))

    async def rooms_for_user(self, user_id: str) -> list[str]:
        return await self._b.read_rooms(lambda r: r.rooms_for_user(user_id))

    async def current_hosts(self, room_id: str) -> frozenset[str]:
        return await self._b.read_rooms(lambda r: r.current_hosts(room_id))

    async def receipt_hosts(self, room_id: str) -> frozenset[str]:
        return await self._b.read_rooms(lambda r: r.receipt_hosts(room_id))

    async def event_meta(self, room_id: str, event_id: str) -> EventMeta | None:
        return await self._b.read_rooms(lambda r: r.event_meta(room_id, event_id))
