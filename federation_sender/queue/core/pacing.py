"""Pacing what is sent to a receiver that stages it, so that it keeps every event.

Synapse answers ``/send`` once a transaction's PDUs are in its inbound staging table
(``federation_inbound_events_staging``), before it processes them, one room at a
time. Once a room holds 100 staged events it prunes them down to their forward
extremities (``prune_staged_events_in_room``): what was pruned is absent until someone
backfills. A backlog of one room sent back to back (a transaction holds at most 50
PDUs) fills that queue faster than it drains: a catch-up replay, and just as much the
events the fan-out hands over after a restart.

So the queue keeps, per room, the PDUs the receiver accepted that are not yet
*confirmed*, oldest first. Once a room has ``confirm_after`` (40) of them, the next
transaction waits until the receiver holds enough of them that at most
``confirm_after - 1`` (39) are left: the runner asks for the one whose confirmation
leaves that many (``GET /_matrix/federation/v1/event/{eventId}``). Synapse answers that
from its events table (``on_pdu_request``, ``get_persisted_pdu``): a 200 means the
event was processed and persisted, and since a room's staged events are processed
oldest first, so were the ones before it; a 404 means not yet. At most
``confirm_after - 1`` + one transaction (50) of our events of a room are then staged at
once: 89, under 100.

Asking for the newest would keep the same bound, but the receiver would run dry before
every transaction: it finishes the room's last event, then idles while the sender
notices (the polls below), asks, and sends the next 50. Asking for the one 39 events
older keeps 39 staged for the receiver to work on over that time, so a backlog reaches
it about as fast as it processes events, with the same one request per transaction.

That reading of a 200 holds only for an event the receiver did not hold before we sent
it. A catch-up replay may send again what the receiver holds (below), so for a room
with replayed PDUs unconfirmed the runner asks for the newest of them, as before: for a
page of ``confirm_after`` or more, the replay's check (``pages_of``) made sure the
receiver did not hold that one.

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

from collections.abc import Collection, Iterator, KeysView
from dataclasses import dataclass

from federation_sender.queue.core.batching import Batch

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

    __slots__ = ("_held", "_replayed", "_rooms", "max_rooms", "policy")

    def __init__(self, policy: PacingPolicy, max_rooms: int = 10_000) -> None:
        self.policy = policy
        self.max_rooms = max_rooms
        self._held: dict[str, None] = {}
        """The rooms with ``confirm_after`` PDUs unconfirmed, in the order they got
        there (a dict: :meth:`due` asks in a stable order)."""
        self._rooms: dict[str, tuple[str, ...]] = {}
        """room -> the event ids of its newest unconfirmed PDUs, oldest first: at most
        ``confirm_after`` of them, all that :meth:`to_confirm` can ask for (a room
        with that many is due; the older ones are confirmed with the one asked for).
        Tuples, sized exactly: a 10,000-server room keeps one per destination."""
        self._replayed: set[str] | None = None
        """Rooms with PDUs of a catch-up replay among their unconfirmed ones (None:
        none, the common case, without a set per queue)."""

    def sent(self, batch: Batch, refused: Collection[str] = ()) -> None:
        """The receiver accepted ``batch`` (``refused``: PDUs its answer refused; they
        are never persisted, so never waited for)."""
        if not self.policy.enabled:
            return
        rooms = self._rooms
        pdus = batch.pdus
        keep = self.policy.confirm_after
        if batch.catchup:
            replayed = {p.room_id for p in pdus if p.event_id not in refused}
            if replayed:
                self._replayed = replayed | (self._replayed or set())
        if pdus and not refused and len({p.room_id for p in pdus}) == 1:
            # One room, nothing refused (a busy room's every transaction): one lookup.
            self._add(pdus[0].room_id, [p.event_id for p in pdus[-keep:]])
        else:
            added: dict[str, list[str]] = {}
            for pdu in pdus:
                if pdu.event_id not in refused:
                    added.setdefault(pdu.room_id, []).append(pdu.event_id)
            for room_id, ids in added.items():
                self._add(room_id, ids)
        if len(rooms) > self.max_rooms:
            # Rooms with few unconfirmed PDUs go first: they are no risk.
            for room, _ in sorted(rooms.items(), key=lambda kv: len(kv[1]))[
                    : len(rooms) - self.max_rooms]:
                self._drop(room)

    def _add(self, room_id: str, ids: list[str]) -> None:
        keep = self.policy.confirm_after
        old = self._rooms.get(room_id)
        if old is not None and len(ids) < keep:
            now = self._rooms[room_id] = (old + tuple(ids))[-keep:]
        else:
            now = self._rooms[room_id] = tuple(ids[-keep:])
        if len(now) >= keep:
            self._held[room_id] = None

    def _drop(self, room_id: str) -> None:
        del self._rooms[room_id]
        self._held.pop(room_id, None)
        if self._replayed is not None:
            self._replayed.discard(room_id)
            if not self._replayed:
                self._replayed = None

    @property
    def held(self) -> KeysView[str]:
        """The rooms with ``confirm_after`` PDUs unconfirmed: due for a confirmation,
        their next PDUs held back until it comes (a live view; the composer reads it)."""
        return self._held.keys()

    def to_confirm(self) -> tuple[str, str] | None:
        """The first of :meth:`due`, or None: nothing is held back."""
        due = self.due()
        return due[0] if due else None

    def due(self) -> list[tuple[str, str]]:
        """(room, event id) for each held room: the event the receiver must hold before
        the room's next PDUs go. Holding it leaves ``confirm_after - 1`` of the room's
        PDUs unconfirmed; it is the newest for a room with replayed PDUs unconfirmed,
        or when ``confirm_after`` is 1."""
        confirm_after = self.policy.confirm_after
        replayed = self._replayed
        out: list[tuple[str, str]] = []
        for room in self._held:
            ids = self._rooms[room]
            if replayed is not None and room in replayed:
                out.append((room, ids[-1]))
            else:
                out.append((room, ids[len(ids) - confirm_after]))
        return out

    def confirmed(self, room_id: str, event_id: str) -> None:
        """The receiver holds ``event_id``, and so the room's PDUs sent before it."""
        ids = self._rooms.get(room_id)
        if ids is None or event_id not in ids:
            return  # not one of the room's newest unconfirmed: nothing to drop
        rest = ids[ids.index(event_id) + 1:]
        if rest:
            self._rooms[room_id] = rest
            if len(rest) < self.policy.confirm_after:
                self._held.pop(room_id, None)
        else:
            self._drop(room_id)

    def forget(self) -> None:
        """A confirmation was given up: nothing is waited for until sent again."""
        self._rooms.clear()
        self._held.clear()
        self._replayed = None


def pages_of(batch: Batch, confirm_after: int) -> list[tuple[str, frozenset[str]]]:
    """The rooms of a catch-up ``batch`` with at least ``confirm_after`` PDUs in it:
    (its newest PDU's event id, the event ids of its PDUs), in the batch's order."""
    rooms: dict[str, list[str]] = {}
    for pdu in batch.pdus:
        rooms.setdefault(pdu.room_id, []).append(pdu.event_id)
    return [(ids[-1], frozenset(ids)) for ids in rooms.values() if len(ids) >= confirm_after]
