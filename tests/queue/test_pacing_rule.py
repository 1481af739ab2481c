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
from federation_sender.queue.core.batching import Batch, Limits, take_batch
from federation_sender.queue.core.catchup import RoomPlan, pack_next, pdu_item
from federation_sender.queue.core.items import PendingItems
from federation_sender.queue.core.pacing import PacingPolicy, RoomPacer

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
    peak, waited, _ = staged_trace(batches, pacer)
    return peak, waited


def staged_trace(batches: list[Batch],
                 pacer: RoomPacer) -> tuple[int, list[str], list[int]]:
    """As :func:`staged_peak`, and the room's staged events as each transaction goes
    out (before it: what the receiver still has to work on)."""
    staged: dict[str, list[str]] = {}
    peak = 0
    waited: list[str] = []
    before: list[int] = []
    for b in batches:
        before.append(sum(len(ids) for ids in staged.values()))
        for p in b.pdus:
            staged.setdefault(p.room_id, []).append(p.event_id)
        peak = max([peak, *map(len, staged.values())])
        pacer.sent(b)
        while (due := pacer.to_confirm()) is not None:
            room, event_id = due
            waited.append(event_id)
            ids = staged[room]  # the receiver processed the room up to event_id
            del ids[: ids.index(event_id) + 1]
            pacer.confirmed(room, event_id)
    return peak, waited, before


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


def live_batches(n: int, handover: int = 100) -> tuple[list[Any], list[Batch]]:
    """The fan-out hands over ``handover`` events at a time (as after a restart); the
    queue sends them 50 a transaction."""
    evs = [pdu_item(e) for e in events(ROOM, n)]
    pending = PendingItems()
    out = []
    for i in range(0, n, handover):
        for item in evs[i:i + handover]:
            pending.add_pdu(item)
        while pending.pdus:
            out.append(take_batch(pending, Limits(max_pdus=50)))
    return evs, out


def test_live_handovers_after_a_restart_are_paced_too() -> None:
    """The queue sends them back to back, as fast as the receiver answers /send."""
    _, out = live_batches(1000)
    peak, waited = staged_peak(out, RoomPacer(PacingPolicy()))
    assert peak <= 89 and len(waited) == 20
    unpaced_peak, _ = staged_peak(out, RoomPacer(PacingPolicy(deadline_s=0)))
    assert unpaced_peak == 1000


def test_a_live_backlog_keeps_the_receiver_busy() -> None:
    """Each confirmation asks for the event 39 older than the newest: while the backlog
    lasts, the receiver still has 39 staged when the next transaction goes out, never
    more than 89 after it, and one request per transaction as before."""
    evs, out = live_batches(1000)
    peak, waited, before = staged_trace(out, RoomPacer(PacingPolicy()))
    assert peak == 89
    assert before == [0] + [39] * 19
    assert waited == [evs[i].event_id for i in range(10, 1000, 50)]


def test_a_replayed_room_waits_for_its_newest_then_live_goes_on_pipelined() -> None:
    """A catch-up replay may send again what the receiver held before, whose 200 says
    nothing of what is staged: its room waits for its newest. Once that is confirmed,
    live transactions of the room are confirmed 39 behind again."""
    evs = events(ROOM, 150)
    replay = Batch(tuple(pdu_item(e) for e in evs[:50]), (), True)
    pacer = RoomPacer(PacingPolicy())
    pacer.sent(replay)
    assert pacer.to_confirm() == (ROOM, evs[49].event_id)
    pacer.confirmed(ROOM, evs[49].event_id)
    assert pacer.to_confirm() is None
    pacer.sent(Batch(tuple(pdu_item(e) for e in evs[50:100]), ()))
    assert pacer.to_confirm() == (ROOM, evs[60].event_id)
    pacer.confirmed(ROOM, evs[60].event_id)
    pacer.sent(Batch(tuple(pdu_item(e) for e in evs[100:110]), (), True))
    assert pacer.to_confirm() == (ROOM, evs[109].event_id)  # a replay again: newest


def test_a_confirmation_of_an_unknown_event_changes_nothing() -> None:
    evs = [pdu_item(e) for e in events(ROOM, 45)]
    pacer = RoomPacer(PacingPolicy())
    pacer.sent(Batch(tuple(evs), ()))
    pacer.confirmed(ROOM, "$elsewhere")
    pacer.confirmed("!other:l", evs[0].event_id)
    assert pacer.to_confirm() == (ROOM, evs[5].event_id)


def test_rooms_are_counted_apart_and_quiet_rooms_never_wait() -> None:
    pacer = RoomPacer(PacingPolicy())
    for i in range(30):
        pacer.sent(Batch(tuple(pdu_item(e) for e in events(f"!r{i}:l", 39, i * 100)), ()))
        assert pacer.to_confirm() is None
    pacer.sent(Batch((pdu_item(events("!r0:l", 1, 5000)[0]),), ()))
    assert pacer.to_confirm() == ("!r0:l", "$r00")


def test_a_refused_event_is_not_waited_for() -> None:
    """The receiver's answer refused a PDU: it will never hold it."""
    evs = [pdu_item(e) for e in events(ROOM, 40)]
    pacer = RoomPacer(PacingPolicy())
    pacer.sent(Batch(tuple(evs), ()), {evs[-1].event_id})
    assert pacer.to_confirm() is None
    pacer.sent(Batch((pdu_item(events(ROOM, 1, 41)[0]),), ()))
    assert pacer.to_confirm() == (ROOM, "$lo1")
    pacer.sent(Batch((pdu_item(events(ROOM, 1, 42)[0]),), (), True), {"$lo42"})
    assert pacer.to_confirm() == (ROOM, "$lo1")  # a refused replay marks nothing


def test_the_pacer_is_bounded() -> None:
    pacer = RoomPacer(PacingPolicy(), max_rooms=10)
    busy = events("!busy:l", 39)
    pacer.sent(Batch(tuple(pdu_item(e) for e in busy), ()))
    for i in range(20):
        pacer.sent(Batch((pdu_item(events(f"!q{i}:l", 1, 1000 + i)[0]),), (), True))
    pacer.sent(Batch((pdu_item(events("!busy:l", 1, 99)[0]),), ()))
    assert pacer.to_confirm() == ("!busy:l", "$bu1")


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
                                   min_size=0, max_size=60), st.booleans()), max_size=6))
def test_what_the_pacer_asks_for_is_a_per_pdu_model(
        sends: list[tuple[list[Any], bool]]) -> None:
    """The one-room shortcut and the general path agree with a plain per-PDU model:
    after any sequence of batches (rooms mixed or not, some PDUs refused, some
    replayed), the room due is the first with 40 accepted and unconfirmed, and the
    event asked for leaves 39 of them, or is the newest if any was replayed."""
    pacer = RoomPacer(PacingPolicy())
    model: dict[str, list[str]] = {}
    replayed: set[str] = set()
    seq = itertools.count(1)
    for spec, catchup in sends:
        items = [(pdu_item(events(f"!{room}:l", 1, next(seq))[0]), refused)
                 for room, refused in spec]
        refused_ids = {i.event_id for i, r in items if r}
        pacer.sent(Batch(tuple(i for i, _ in items), (), catchup), refused_ids)
        for item, refused in items:
            if not refused:
                model.setdefault(item.room_id, []).append(item.event_id)
                if catchup:
                    replayed.add(item.room_id)
        want = next(((room, ids[-1] if room in replayed else ids[len(ids) - 40])
                     for room, ids in model.items() if len(ids) >= 40), None)
        assert pacer.to_confirm() == want
        if want is not None:
            pacer.confirmed(*want)
            ids = model[want[0]]
            del ids[: ids.index(want[1]) + 1]
            if not ids:
                del model[want[0]]
                replayed.discard(want[0])
