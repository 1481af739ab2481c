from __future__ import annotations

import json

from federation_sender.model import EventRow, MembershipRow
from federation_sender.queue.core.batching import Limits
from federation_sender.queue.core.catchup import RoomInput, RoomPlan, pack_next, plan_room
from federation_sender.queue.core.episode import CatchupEpisode

ME = "local.test"
D = "remote.test"


def ev(so: int, sender: str = f"@a:{ME}", *, etype: str = "m.room.message",
       state_key: str | None = None, outlier: bool = False) -> EventRow:
    return EventRow(so, f"$e{so}", "!r", etype, state_key, sender, outlier, False,
                    json.dumps({"event_id": f"$e{so}"}))


JOINED = [MembershipRow(1, f"@b:{D}", D, "join")]


def inp(missed: list[EventRow], *, ext: list[EventRow] | None = None, partial: bool = False,
        history: list[MembershipRow] | None = None, row_so: int | None = None,
        row_event: EventRow | None = None) -> RoomInput:
    so = row_so if row_so is not None else (missed[-1].stream_ordering if missed else 10)
    return RoomInput("!r", so, missed, ext or [], partial,
                     JOINED if history is None else history,
                     row_event if row_event is not None else (missed[-1] if missed else None))


def test_short_gap_replays_our_visible_events_in_order() -> None:
    missed = [ev(5), ev(6, f"@x:{D}"), ev(7, outlier=True), ev(8)]
    p = plan_room(inp(missed), D, ME, max_gap_events=50)
    assert p.mode == "gap"
    assert [e.stream_ordering for e in p.events] == [5, 8]
    assert not p.prune


def test_long_gap_sends_visible_extremities() -> None:
    missed = [ev(i) for i in range(2, 60)]
    extremities = [ev(100, f"@x:{D}"), ev(101)]
    p = plan_room(inp(missed, ext=extremities), D, ME, max_gap_events=50)
    assert p.mode == "extremities"
    assert [e.event_id for e in p.events] == ["$e100", "$e101"]


def test_extremity_the_destination_could_not_see_falls_back_to_the_event() -> None:
    missed = [ev(i) for i in range(2, 60)]
    history = [MembershipRow(1, f"@b:{D}", D, "join"), MembershipRow(90, f"@b:{D}", D, "leave")]
    p = plan_room(inp(missed, ext=[ev(100)], history=history, row_so=59), D, ME, 50)
    assert p.mode == "event"
    assert [e.stream_ordering for e in p.events] == [59]
    assert p.prune  # it has left the room: the row is dropped once handled


def test_partial_state_room_sends_the_event_itself() -> None:
    missed = [ev(i) for i in range(2, 60)]
    p = plan_room(inp(missed, ext=[ev(100)], partial=True), D, ME, 50)
    assert p.mode == "event"
    assert [e.stream_ordering for e in p.events] == [59]


def test_own_kick_is_sent_though_no_longer_joined() -> None:
    kick = ev(5, etype="m.room.member", state_key=f"@b:{D}")
    history = [MembershipRow(1, f"@b:{D}", D, "join"), MembershipRow(5, f"@b:{D}", D, "leave")]
    p = plan_room(inp([ev(4), kick], history=history), D, ME, 50)
    assert [e.stream_ordering for e in p.events] == [4, 5]
    assert p.prune


def test_purged_room_is_pruned_with_nothing_to_send() -> None:
    p = plan_room(inp([], row_so=9), D, ME, 50)
    assert p.events == () and p.prune and p.mode == "none"


def plan(so: int, n: int, prune: bool = False) -> RoomPlan:
    return RoomPlan(f"!r{so}", so, tuple(ev(so * 100 + i) for i in range(n)), prune, "gap")


def test_pack_respects_rooms_per_txn_pdu_limit_and_positions() -> None:
    plans = [plan(1, 10), plan(2, 10, prune=True), plan(3, 45), plan(4, 0)]
    b1 = pack_next(plans, 2, Limits())
    assert len(b1.pdus) == 20 and b1.catchup_position == 2
    assert b1.catchup_prune == (("!r2", 2),)
    b2 = pack_next(plans, 50, Limits())
    assert len(b2.pdus) == 45 and b2.catchup_position == 4  # empty room rides along
    assert not plans


def test_pack_chunks_a_room_larger_than_a_transaction() -> None:
    plans = [plan(1, 120)]
    sizes, positions = [], []
    while plans:
        b = pack_next(plans, 1, Limits())
        sizes.append(len(b.pdus))
        positions.append(b.catchup_position)
    assert sizes == [50, 50, 20] and positions == [None, None, 1]


def test_withheld_events_are_not_replayed_in_a_gap() -> None:
    missed = [ev(5), ev(6), ev(7)]
    p = plan_room(_withholding(inp(missed), "$e6"), D, ME, 50)
    assert [e.stream_ordering for e in p.events] == [5, 7]
    assert not p.prune


def test_withheld_gap_leaves_nothing_and_prunes() -> None:
    p = plan_room(_withholding(inp([ev(5), ev(6)]), "$e5", "$e6"), D, ME, 50)
    assert p.events == () and p.prune


def test_withheld_extremity_and_withheld_row_event_send_nothing() -> None:
    missed = [ev(i) for i in range(2, 60)]
    extremities = [ev(100), ev(101)]
    base = inp(missed, ext=extremities, row_so=59)
    p = plan_room(_withholding(base, "$e100"), D, ME, 50)
    assert (p.mode, [e.event_id for e in p.events]) == ("extremities", ["$e101"])
    p = plan_room(_withholding(base, "$e100", "$e101"), D, ME, 50)
    assert (p.mode, [e.event_id for e in p.events]) == ("event", ["$e59"])
    p = plan_room(_withholding(base, "$e100", "$e101", "$e59"), D, ME, 50)
    assert p.events == () and p.prune


def test_withheld_row_event_of_a_partial_state_room_is_not_sent() -> None:
    missed = [ev(i) for i in range(2, 60)]
    p = plan_room(_withholding(inp(missed, partial=True), "$e59"), D, ME, 50)
    assert p.events == () and p.prune


def _withholding(base: RoomInput, *event_ids: str) -> RoomInput:
    return RoomInput(base.room_id, base.row_stream_ordering, base.missed, base.extremities,
                     base.partial_state, base.history, base.row_event, frozenset(event_ids))


def test_pack_ends_the_batch_at_a_page_and_advances_nothing_for_it() -> None:
    page = RoomPlan("!long", 9, tuple(ev(900 + i) for i in range(30)), False, "page",
                    more=True, read_upto=935, cut=True)
    plans = [plan(1, 5, prune=True), page]
    b = pack_next(plans, 8, Limits())
    assert len(b.pdus) == 35 and not plans
    assert b.catchup_position == 1 and b.catchup_prune == (("!r1", 1),)  # not the page's


def test_a_page_holds_the_cursor_before_its_room_and_keeps_reading() -> None:
    ep = CatchupEpisode(active=True)
    ep.reset(0)
    page = RoomPlan("!long", 9, (ev(3), ev(4)), False, "page", more=True, read_upto=5,
                    cut=True)
    ep.offer([plan(1, 1), page], exhausted=True)  # fewer plans than asked: not the end
    assert ep.cursor == (1, "!r1") and not ep.exhausted
    assert ep.room_floor["!long"] == 5
    # The next read takes the room again: its events up to the floor are not resent.
    rest = RoomPlan("!long", 9, (ev(4), ev(6), ev(9)), False, "gap", cut=True)
    ep.offer([rest], exhausted=True)
    assert [e.stream_ordering for e in ep.plans[-1].events] == [6, 9]
    assert ep.cursor == (9, "!long") and not ep.exhausted  # the read stopped at it
    ep.offer([], exhausted=True)
    assert ep.exhausted
