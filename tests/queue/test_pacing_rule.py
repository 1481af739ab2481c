"""The pacing policy (pure): when a queue waits for the receiver to process what it
accepted, which event it asks for, how often, and when a destination is no longer
paced."""

from __future__ import annotations

import itertools
import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from federation_sender.model import EventRow
from federation_sender.queue.batching import Batch, Limits, take_batch
from federation_sender.queue.catchup import RoomPlan, pack_next, pdu_item
from federation_sender.queue.items import PendingItems
from federation_sender.queue.pacing import PacingPolicy, RoomPacer

ROOM = "!long:l"


def events(room: str, n: int, start: int = 1) -> tuple[EventRow, ...]:
    return tuple(
        EventRow(start + i, f"${room[1:3]}{start + i}", room, "m.room.message", None,
                 "@a:l", False, False,
                 json.dumps({"type": "m.room.message", "room_id": room}))
        for i in range(n)
    )


def staged_peak(batches: list[Batch], pacer: RoomPacer) -> tuple[int, list[str]]:
    """Send ``batches`` through ``pacer`` against a receiver that processes only what
    a confirmation waits for: the most events of one room staged at once, and the
    events waited for."""
    staged: dict[str, int] = {}
    peak = 0
    waited: list[str] = []
    for b in batches:
        for p in b.pdus:
            staged[p.room_id] = staged.get(p.room_id, 0) + 1
        peak = max([peak, *staged.values()])
        pacer.sent(b)
        while (due := pacer.to_confirm()) is not None:
            room, event_id = due
            waited.append(event_id)
            staged[room] = 0  # the receiver processed the room up to event_id
            pacer.confirmed(room)
    return peak, waited


def test_a_catch_up_replay_never_stages_100_events_of_a_room() -> None:
    """150 missed events of one room go out 50 at a time; before the next transaction
    the room's newest is confirmed once 40 are unconfirmed."""
    evs = events(ROOM, 150)
    plans = [RoomPlan(ROOM, 150, evs, False, "gap")]
    out = []
    while plans:
        out.append(pack_next(plans, 8, Limits(max_pdus=50)))
    peak, waited = staged_peak(out, RoomPacer(PacingPolicy()))
    assert [len(b.pdus) for b in out] == [50, 50, 50]
    assert waited == [evs[49].event_id, evs[99].event_id, evs[149].event_id]
    assert peak == 50 < 100


def test_live_handovers_after_a_restart_are_paced_too() -> None:
    """The intake hands over 100 events at a time after a restart; the queue sends
    them 50 a transaction, back to back, as fast as the receiver answers /send."""
    evs = [pdu_item(e) for e in events(ROOM, 1000)]
    pending = PendingItems()
    out = []
    for i in range(0, 1000, 100):
        for item in evs[i:i + 100]:
            pending.add_pdu(item)
        while pending.pdus:
            out.append(take_batch(pending, Limits(max_pdus=50)))
    peak, waited = staged_peak(out, RoomPacer(PacingPolicy()))
    assert peak <= 89 and len(waited) == 20
    unpaced_peak, _ = staged_peak(out, RoomPacer(PacingPolicy(deadline_s=0)))
    assert unpaced_peak == 1000


def test_rooms_are_counted_apart_and_quiet_rooms_never_wait() -> None:
    pacer = RoomPacer(PacingPolicy())
    for i in range(30):
        pacer.sent(Batch(tuple(pdu_item(e) for e in events(f"!r{i}:l", 39, i * 100)), ()))
        assert pacer.to_confirm() is None
    pacer.sent(Batch((pdu_item(events("!r0:l", 1, 5000)[0]),), ()))
    assert pacer.to_confirm() == ("!r0:l", "$r05000")


def test_a_refused_event_is_not_waited_for() -> None:
    """The receiver's answer refused a PDU: it will never hold it."""
    evs = [pdu_item(e) for e in events(ROOM, 40)]
    pacer = RoomPacer(PacingPolicy())
    pacer.sent(Batch(tuple(evs), ()), {evs[-1].event_id})
    assert pacer.to_confirm() is None
    pacer.sent(Batch((pdu_item(events(ROOM, 1, 41)[0]),), ()))
    assert pacer.to_confirm() == (ROOM, "$lo41")


def test_the_pacer_is_bounded() -> None:
    pacer = RoomPacer(PacingPolicy(), max_rooms=10)
    busy = events("!busy:l", 39)
    pacer.sent(Batch(tuple(pdu_item(e) for e in busy), ()))
    for i in range(20):
        pacer.sent(Batch((pdu_item(events(f"!q{i}:l", 1, 1000 + i)[0]),), ()))
    pacer.sent(Batch((pdu_item(events("!busy:l", 1, 99)[0]),), ()))
    assert pacer.to_confirm() == ("!busy:l", "$bu99")


def test_polls_double_up_to_the_cap() -> None:
    delays = list(itertools.islice(PacingPolicy(first_poll_s=0.05, max_poll_s=1.0)
                                   .poll_delays(), 7))
    assert delays == [0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0]


def test_a_failed_confirmation_turns_pacing_off_for_a_while() -> None:
    pacing = PacingPolicy(off_after_failure_s=600)
    assert pacing.paced_after(None, 5.0)
    assert not pacing.paced_after(100.0, 699.0)
    assert pacing.paced_after(100.0, 700.0)
    assert not PacingPolicy(deadline_s=0).paced_after(None, 5.0)


@given(st.lists(st.tuples(st.lists(st.tuples(st.sampled_from("abc"), st.booleans()),
                                   min_size=0, max_size=60)), max_size=6))
def test_what_the_pacer_asks_for_is_a_per_pdu_count(sends: list[tuple[list[Any]]]) -> None:
    """The one-room shortcut and the general path count alike: after any sequence of
    batches (rooms mixed or not, some PDUs refused), the room due and its newest
    accepted event are those of a plain per-PDU count."""
    pacer = RoomPacer(PacingPolicy())
    model: dict[str, tuple[int, str]] = {}
    seq = itertools.count(1)
    for (spec,) in sends:
        items = [(pdu_item(events(f"!{room}:l", 1, next(seq))[0]), refused)
                 for room, refused in spec]
        refused_ids = {i.event_id for i, r in items if r}
        pacer.sent(Batch(tuple(i for i, _ in items), ()), refused_ids)
        for item, refused in items:
            if not refused:
                n, _ = model.get(item.room_id, (0, ""))
                model[item.room_id] = (n + 1, item.event_id)
        want = next(((room, ev) for room, (n, ev) in model.items() if n >= 40), None)
        assert pacer.to_confirm() == want
        if want is not None:
            pacer.confirmed(want[0])
            del model[want[0]]
