"""Value types the simulator produces: events, EDU outbox entries, and batches of them.

A :class:`Batch` is what one step of the world produces and what one database
transaction persists. Events carry no stream ordering: the writer assigns stream ids
when the batch is persisted, in list order (see :mod:`federation_sender.sim.store`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class SimEvent:
    """One event as the main process would persist it.

    ``hosts`` is the oracle's answer, fixed when the event is created: the remote
    servers the worker must send this event to. It is empty unless the event is local
    (sent by a user on our server) and not an outlier. Otherwise it is every remote
    server joined to the room just before or just after the event, so a server whose
    last user is kicked, banned or leaves still receives that event, and a joining
    server receives its own join.
    """

    event_id: str
    room_id: str
    type: str
    state_key: str | None
    sender: str
    origin_server_ts: int
    pdu: dict[str, Any]
    membership: str | None
    local: bool
    outlier: bool
    hosts: frozenset[str]
    extremities_after: tuple[str, ...]
    """The room's forward extremities once this event is persisted."""


@dataclass(frozen=True, slots=True)
class ToDeviceMessage:
    """A row of ``device_federation_outbox``: an ``m.direct_to_device`` EDU's content."""

    destination: str
    message_id: str
    content: dict[str, Any]


@dataclass(frozen=True, slots=True)
class DeviceListChange:
    """A local user's device changed: one poke per remote server sharing a room."""

    user_id: str
    device_id: str
    destinations: frozenset[str]
    content: dict[str, Any]


@dataclass(slots=True)
class Batch:
    """Everything one transaction writes, in order."""

    events: list[SimEvent] = field(default_factory=list)
    partial_state_added: list[str] = field(default_factory=list)
    partial_state_removed: list[str] = field(default_factory=list)
    to_device: list[ToDeviceMessage] = field(default_factory=list)
    device_changes: list[DeviceListChange] = field(default_factory=list)

    def extend(self, other: Batch) -> None:
        self.events.extend(other.events)
        self.partial_state_added.extend(other.partial_state_added)
        self.partial_state_removed.extend(other.partial_state_removed)
        self.to_device.extend(other.to_device)
        self.device_changes.extend(other.device_changes)

    def __len__(self) -> int:
        return (
            len(self.events)
            + len(self.partial_state_added)
            + len(self.partial_state_removed)
            + len(self.to_device)
            + len(self.device_changes)
        )
