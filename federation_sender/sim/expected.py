"""The oracle: what every destination should receive, computed from the world in memory.

It never reads the database: it is fed the persisted events (with their stream
orderings) and uses each event's ``hosts``, which :class:`~.world.World` fixed from its
own membership model when it created the event. So the oracle and the worker (which
derives hosts from ``room_memberships`` in SQL) are independent computations of the
same rule, and the delivery check compares them.

For each destination the oracle keeps

* ``should_receive``: every local, non-outlier event it is a host of, in stream order
  (what live sending with no failures would deliver);
* ``latest``: per room, the last of those (what catch-up must at least deliver: after
  catch-up a destination may see the room's latest extremity instead of every event,
  so the check accepts "this event or a later one of the same room");
* to-device message ids (each must arrive: to-device EDUs are not coalesced);
* device-list changes: per (user, device), the highest stream id poked (updates for
  one device may be coalesced, so the latest must arrive).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from federation_sender.sim.store import PersistedBatch, PersistedEvent


@dataclass(frozen=True, slots=True)
class ExpectedEvent:
    stream_ordering: int
    event_id: str
    room_id: str
    local: bool = True
    """Written by our server (a remote's event reaches others only as a catch-up
    forward extremity)."""


@dataclass(slots=True)
class DestinationExpectations:
    should_receive: list[ExpectedEvent] = field(default_factory=list)
    latest: dict[str, ExpectedEvent] = field(default_factory=dict)
    to_device_message_ids: set[str] = field(default_factory=set)
    device_updates: dict[tuple[str, str], int] = field(default_factory=dict)


class Oracle:
    def __init__(self) -> None:
        self.destinations: dict[str, DestinationExpectations] = {}
        self.events_by_id: dict[str, ExpectedEvent] = {}
        """Every event the simulator wrote (local or not, outlier or not), so the check
        can tell a PDU sent to the wrong server from one that was never written."""
        self.max_stream_ordering = 0

    def _dest(self, destination: str) -> DestinationExpectations:
        d = self.destinations.get(destination)
        if d is None:
            d = self.destinations[destination] = DestinationExpectations()
        return d

    def observe_events(self, events: Iterable[PersistedEvent]) -> None:
        for p in events:
            e = p.event
            self.max_stream_ordering = max(self.max_stream_ordering, p.stream_ordering)
            exp = ExpectedEvent(p.stream_ordering, e.event_id, e.room_id, e.local)
            self.events_by_id[e.event_id] = exp
            for host in e.hosts:
                d = self._dest(host)
                d.should_receive.append(exp)
                d.latest[e.room_id] = exp

    def observe(self, batch: PersistedBatch) -> None:
        self.observe_events(batch.events)
        for t in batch.to_device:
            self._dest(t.message.destination).to_device_message_ids.add(t.message.message_id)
        for c in batch.device_changes:
            for dest in c.change.destinations:
                updates = self._dest(dest).device_updates
                key = (c.change.user_id, c.change.device_id)
                updates[key] = max(updates.get(key, 0), c.stream_id)

    def latest(self, destination: str, room_id: str) -> ExpectedEvent | None:
        d = self.destinations.get(destination)
        return d.latest.get(room_id) if d else None

    def should_receive(self, destination: str) -> list[ExpectedEvent]:
        d = self.destinations.get(destination)
        return list(d.should_receive) if d else []
