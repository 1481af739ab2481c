"""The catch-up pacing policy (pure): which event to confirm after a catch-up
transaction, how often to ask, and when a destination is no longer paced."""

from __future__ import annotations

import itertools
import json

from federation_sender.model import EventRow
from federation_sender.queue.batching import Batch, Limits
from federation_sender.queue.catchup import RoomPlan, pack_next
from federation_sender.queue.pacing import CatchupPacing

ROOM = "!long:l"


def events(room: str, n: int, start: int = 1) -> tuple[EventRow, ...]:
    return tuple(
        EventRow(start + i, f"${room[1:3]}{start + i}", room, "m.room.message", None,
                 "@a:l", False, False,
                 json.dumps({"type": "m.room.message", "room_id": room}))
        for i in range(n)
    )


def batches(plans: list[RoomPlan], limits: Limits, rooms: int = 8) -> list[Batch]:
    out = []
    while plans:
        out.append(pack_next(plans, rooms, limits))
    return out


def test_a_long_room_is_confirmed_chunk_by_chunk() -> None:
    """150 missed events of one room go out 50 at a time: after each chunk that leaves
    the rest of the room for later, the chunk's last event is confirmed, so the
    receiver never holds more than one chunk (50 < Synapse's 100) staged."""
    evs = events(ROOM, 150)
    out = batches([RoomPlan(ROOM, 150, evs, False, "gap")], Limits(max_pdus=50))
    pacing = CatchupPacing()
    assert [len(b.pdus) for b in out] == [50, 50, 50]
    assert [pacing.event_to_confirm(b) for b in out] == [
        evs[49].event_id, evs[99].event_id, None]


def test_short_rooms_are_not_confirmed() -> None:
    """Rooms that fit one transaction complete in it: nothing is left to follow them
    into the receiver's staging queue, so nothing waits."""
    plans = [RoomPlan(f"!r{i}:l", i * 10, events(f"!r{i}:l", 10, i * 10), False, "gap")
             for i in range(1, 8)]
    out = batches(plans, Limits(max_pdus=50))
    assert out and all(CatchupPacing().event_to_confirm(b) is None for b in out)


def test_live_batches_and_disabled_pacing_are_not_confirmed() -> None:
    evs = events(ROOM, 120)
    chunk = pack_next([RoomPlan(ROOM, 120, evs, False, "gap")], 8, Limits(max_pdus=50))
    assert CatchupPacing(deadline_s=0).event_to_confirm(chunk) is None
    live = Batch(chunk.pdus, ())
    assert CatchupPacing().event_to_confirm(live) is None


def test_a_refused_last_event_is_not_waited_for() -> None:
    """The receiver's answer refused the chunk's last PDU: it will never hold it, so
    the one before it is confirmed instead."""
    evs = events(ROOM, 120)
    chunk = pack_next([RoomPlan(ROOM, 120, evs, False, "gap")], 8, Limits(max_pdus=50))
    assert CatchupPacing().event_to_confirm(chunk, {evs[49].event_id}) == evs[48].event_id
    everything = {p.event_id for p in chunk.pdus}
    assert CatchupPacing().event_to_confirm(chunk, everything) is None


def test_polls_double_up_to_the_cap() -> None:
    delays = list(itertools.islice(CatchupPacing(first_poll_s=0.05, max_poll_s=1.0)
                                   .poll_delays(), 7))
    assert delays == [0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0]


def test_a_failed_confirmation_turns_pacing_off_for_a_while() -> None:
    pacing = CatchupPacing(off_after_failure_s=600)
    assert pacing.paced_after(None, 5.0)
    assert not pacing.paced_after(100.0, 699.0)
    assert pacing.paced_after(100.0, 700.0)
    assert not CatchupPacing(deadline_s=0).paced_after(None, 5.0)
