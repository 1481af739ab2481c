"""Pacing what is sent to a receiver that stages it, so that it keeps every event.

Synapse answers ``/send`` once a transaction's PDUs are in its inbound staging table
(``federation_inbound_events_staging``), before it processes them, one room at a
time. Once a room holds 100 staged events it prunes them down to their forward
extremities (``prune_staged_events_in_room``): what was pruned is absent until someone
backfills. A backlog of one room sent back to back (a transaction holds at most 50
PDUs) fills that queue faster than it drains: a catch-up replay, and just as much the
events the intake hands over after a restart.

So the queue counts, per room, the PDUs the receiver accepted that are not yet
*confirmed*. Once a room reaches ``confirm_after`` (40) of them, the next transaction
waits until the receiver holds the room's last one: the runner asks for it
(``GET /_matrix/federation/v1/event/{eventId}``). Synapse answers that from its events
table (``on_pdu_request``, ``get_persisted_pdu``): a 200 means the event was processed
and persisted, and since a room's staged events are processed oldest first, so were
the others; a 404 means not yet. At most ``confirm_after - 1`` + one transaction (50)
of our events of a room are then staged at once: 89, under 100.

Bounded: one confirmation has a deadline (``deadline_s``); past it, or when the
receiver does not answer the request at all, the queue sends on as it would without
pacing (the runner logs a line and counts it), and does not pace that destination
again for ``off_after_failure_s``. Only this destination's queue waits; it holds no
transaction slot while it does.

A catch-up replay may resend what the receiver already holds (the first pages of a
room again, after a crash in the middle of its catch-up). Synapse stages those
duplicates too (its staging table is keyed by origin and event id, not checked against
its events), and a confirmation of an event it held before says nothing about them:
pages sent back to back would fill the room's staging queue again. So before sending a
catch-up transaction, the runner asks the receiver for the newest PDU of each room
that has at least ``confirm_after`` PDUs in it (``pages_of``): a room whose newest PDU
it holds is not sent again (it holds that event; the rest of the page was sent before
it, in order). One request per page, none for live traffic or short gaps.

Pure: the runner does the requests and the waiting.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from dataclasses import dataclass

from federation_sender.queue.batching import Batch

__all__ = ["PacingPolicy", "RoomPacer", "pages_of"]


@dataclass(frozen=True, slots=True)
class PacingPolicy:
    deadline_s: float = 30.0
    """How long one confirmation may take; 0 turns pacing off."""
    first_poll_s: float = 0.05
    """The first pause between two requests for the same event (doubling)."""
    max_poll_s: float = 1.0
    """The longest pause between two requests for the same event."""
    off_after_failure_s: float = 600.0
    """After a confirmation failed, this destination is not paced for so long."""
    confirm_after: int = 40
    """Unconfirmed PDUs of one room before the next transaction waits for them."""

    @property
    def enabled(self) -> bool:
        return self.deadline_s > 0

    def poll_delays(self) -> Iterator[float]:
        """Pauses between requests: doubling from ``first_poll_s`` up to ``max_poll_s``."""
        delay = self.first_poll_s
        while True:
            yield delay
            delay = min(self.max_poll_s, delay * 2)

    def paced_after(self, failed_at_s: float | None, now_s: float) -> bool:
        """Whether to confirm for a destination whose last confirmation failed at
        ``failed_at_s`` (monotonic; None: never)."""
        return self.enabled and (
            failed_at_s is None or now_s - failed_at_s >= self.off_after_failure_s
        )


class RoomPacer:
    """The unconfirmed PDUs of one destination, per room (pure, one per queue)."""

    __slots__ = ("_rooms", "max_rooms", "policy")

    def __init__(self, policy: PacingPolicy, max_rooms: int = 10_000) -> None:
        self.policy = policy
        self.max_rooms = max_rooms
        self._rooms: dict[str, tuple[int, str]] = {}
        """room -> (unconfirmed PDUs, the newest of them)."""

    def sent(self, batch: Batch, refused: Collection[str] = ()) -> None:
        """The receiver accepted ``batch`` (``refused``: PDUs its answer refused; they
        are never persisted, so never waited for)."""
        if not self.policy.enabled:
            return
        rooms = self._rooms
        pdus = batch.pdus
        if pdus and not refused and len({p.room_id for p in pdus}) == 1:
            # One room, nothing refused (a busy room's every transaction): one update.
            newest = pdus[-1]
            count, _ = rooms.get(newest.room_id, (0, ""))
            rooms[newest.room_id] = (count + len(pdus), newest.event_id)
        else:
            for pdu in pdus:
                if pdu.event_id in refused:
                    continue
                count, _ = rooms.get(pdu.room_id, (0, ""))
                rooms[pdu.room_id] = (count + 1, pdu.event_id)
        if len(rooms) > self.max_rooms:
            # Rooms with few unconfirmed PDUs go first: they are no risk.
            for room, _ in sorted(rooms.items(), key=lambda kv: kv[1][0])[
                    : len(rooms) - self.max_rooms]:
                del rooms[room]

    def to_confirm(self) -> tuple[str, str] | None:
        """(room, event id) the receiver must hold before the next transaction, or
        None: send on."""
        for room, (count, event_id) in self._rooms.items():
            if count >= self.policy.confirm_after:
                return room, event_id
        return None

    def confirmed(self, room_id: str) -> None:
        """The receiver holds the room's newest PDU (or the wait was given up)."""
        self._rooms.pop(room_id, None)

    def forget(self) -> None:
        self._rooms.clear()


def pages_of(batch: Batch, confirm_after: int) -> list[tuple[str, frozenset[str]]]:
    """The rooms of a catch-up ``batch`` with at least ``confirm_after`` PDUs in it:
    (its newest PDU's event id, the event ids of its PDUs), in the batch's order."""
    rooms: dict[str, list[str]] = {}
    for pdu in batch.pdus:
        rooms.setdefault(pdu.room_id, []).append(pdu.event_id)
    return [(ids[-1], frozenset(ids)) for ids in rooms.values() if len(ids) >= confirm_after]
