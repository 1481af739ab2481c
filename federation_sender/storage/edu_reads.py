"""What the EDU fan-outs read of the backend (rooms, hosts, an event's sender and
reception time, presence states), declared below the storage package so that each
backend's capabilities (:mod:`.capabilities`) can offer them without importing the EDU
fan-outs above it. :mod:`federation_sender.edus` re-exports them."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Protocol

from federation_sender.replication.rows import PresenceState


@dataclass(frozen=True, slots=True)
class EventMeta:
    """What the receipt pacing rule needs to know of the receipt's event."""

    sender: str
    received_ts: int
    """When this server received (or created) the event, in ms."""


class RoomHosts(Protocol):
    """The backend's view of rooms, for ephemeral EDUs."""

    async def current_hosts(self, room_id: str) -> Collection[str]:
        """Servers with a joined member in the room now (our own included or not)."""

    async def receipt_hosts(self, room_id: str) -> Collection[str]:
        """Where a receipt goes: the current hosts, and in a partial-state room also
        the servers in it at our join (Synapse's
        ``get_current_hosts_in_room_or_partial_state_approximation``)."""

    async def event_meta(self, room_id: str, event_id: str) -> EventMeta | None:
        """Sender and reception time of an event; None if unknown."""


class PresenceSource(Protocol):
    """The backend's side of presence."""

    async def startup_states(self) -> list[PresenceState]:
        """Every user's latest state that is not offline."""

    async def states_for_users(self, user_ids: Collection[str]) -> dict[str, PresenceState]:
        """The latest stored state of each user that has one."""

    async def rooms_for_user(self, user_id: str) -> Collection[str]:
        """Rooms the user is joined to now."""

    async def current_hosts(self, room_id: str) -> Collection[str]:
        """Servers with a joined member in the room now."""
