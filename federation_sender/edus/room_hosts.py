"""Rooms' hosts and events' metadata for the EDU fan-outs, through the storage backend."""

from __future__ import annotations

from federation_sender.edus import EventMeta
from federation_sender.storage.protocols import Backend, Tx


class StorageRoomHosts:
    """Implements :class:`federation_sender.edus.RoomHosts` through the storage backend
    (natively: the membership replay, and the event's ``origin_server_ts`` as its
    reception time, as the native schema keeps no other)."""

    def __init__(self, storage: Backend) -> None:
        self._storage = storage

    async def current_hosts(self, room_id: str) -> frozenset[str]:
        async def fn(tx: Tx) -> frozenset[str]:
            return (await tx.hosts.current_hosts([room_id]))[room_id]

        return await self._storage.run(fn)

    async def receipt_hosts(self, room_id: str) -> frozenset[str]:
        """The current hosts (a partial-state room's servers at join are the Synapse
        backend's business)."""
        return await self.current_hosts(room_id)

    async def event_meta(self, room_id: str, event_id: str) -> EventMeta | None:
        async def fn(tx: Tx) -> tuple[str, int] | None:
            return await tx.events.sender_and_received_ts(room_id, event_id)

        found = await self._storage.run(fn)
        return None if found is None else EventMeta(*found)
