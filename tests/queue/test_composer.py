"""The transaction composer (``queue/core/composer.py``, issue #44): a held room holds
back only its own PDUs; what is new goes first; backlogged rooms take turns; each
room's order, the PDU, EDU and byte limits hold. Pure: no I/O."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from federation_sender.queue.core.batching import Batch, Limits, take_batch
from federation_sender.queue.core.composer import (
    LIVE_ROOM_PDUS,
    SCAN_LIMIT,
    RoomRotation,
    compose,
)
from federation_sender.queue.core.items import EduKind, PduItem, PendingItems, make_edu

LIMITS = Limits()
_so = itertools.count(1)


def pdus(room: str, n: int, size: int = 200) -> tuple[PduItem, ...]:
    out = []
    for _ in range(n):
        so = next(_so)
        out.append(PduItem(so, f"$e{so}", room, {"event_id": f"$e{so}"}, size))
    return tuple(out)


def pending_of(*runs: tuple[PduItem, ...]) -> PendingItems:
    p = PendingItems()
    for run in runs:
        p.add_pdus(run)
    return p


def rooms_of(batch: Batch) -> list[str]:
    return [p.room_id for p in batch.pdus]


def test_a_message_in_another_room_goes_in_the_next_transaction_behind_a_held_backlog(
) -> None:
    backlog = pdus("!big", 1_000)
    message = pdus("!chat", 1)
    pending = pending_of(backlog, message)
    b = compose(pending, LIMITS, {"!big"}, RoomRotation())
    assert b.pdus == message
    assert len(pending.pdus) == 1_000 and list(pending.pdus) == list(backlog)


def test_a_to_device_message_goes_while_every_pdu_is_held() -> None:
    pending = pending_of(pdus("!big", 300))
    pending.to_device.append(make_edu(EduKind.TO_DEVICE, "m.direct_to_device", {"m": 1},
                                      (7, "", "")))
    b = compose(pending, LIMITS, {"!big"}, RoomRotation())
    assert not b.pdus and [e.edu_type for e in b.edus] == ["m.direct_to_device"]
    assert len(pending.pdus) == 300
    # Nothing else to send: an empty transaction (the queue then awaits a confirmation).
    assert not compose(pending, LIMITS, {"!big"}, RoomRotation())


def test_live_rooms_first_then_the_backlog_with_the_rest_of_the_slots() -> None:
    backlog = pdus("!big", 500)
    live = [pdus(f"!live{i}", 2) for i in range(3)]
    pending = pending_of(backlog, *live)
    b = compose(pending, LIMITS, set(), RoomRotation())
    assert len(b.pdus) == 50
    assert {p.event_id for run in live for p in run} <= {p.event_id for p in b.pdus}
    assert [p for p in b.pdus if p.room_id == "!big"] == list(backlog[:44])
    # The transaction lists its PDUs in the queue's order.
    assert [p.stream_ordering for p in b.pdus] == sorted(p.stream_ordering for p in b.pdus)


def test_live_pdus_take_at_most_half_while_a_backlog_can_send() -> None:
    live = [pdus(f"!live{i}", 1) for i in range(40)]
    backlog = pdus("!big", 200)
    pending = pending_of(*live, backlog)
    b = compose(pending, LIMITS, set(), RoomRotation())
    assert rooms_of(b).count("!big") == 25 and len(b.pdus) == 50
    # The live PDUs left go next, oldest first.
    b2 = compose(pending, LIMITS, set(), RoomRotation())
    assert [p for p in b2.pdus if p.room_id != "!big"] == [run[0] for run in live[25:]]


def test_ten_backlogged_rooms_each_send_their_first_page_within_ten_transactions() -> None:
    rooms = [f"!r{i}" for i in range(10)]
    pending = pending_of(*[pdus(r, 200) for r in rooms])
    rotation = RoomRotation()
    first_page: dict[str, int] = {}
    sent: dict[str, list[PduItem]] = {r: [] for r in rooms}
    n = 0
    while pending.pdus:
        n += 1
        b = compose(pending, LIMITS, set(), rotation)  # no pacing: a fast receiver
        assert b.pdus
        for p in b.pdus:
            first_page.setdefault(p.room_id, n)
            sent[p.room_id].append(p)
    assert max(first_page.values()) <= 10
    assert n == 2_000 // 50  # every transaction full
    for r in rooms:
        assert [p.stream_ordering for p in sent[r]] == sorted(p.stream_ordering for p in sent[r])
        assert len(sent[r]) == 200


def test_round_robin_with_pacing_holding_each_room_after_its_page() -> None:
    rooms = [f"!r{i}" for i in range(10)]
    pending = pending_of(*[pdus(r, 200) for r in rooms])
    rotation = RoomRotation()
    held: set[str] = set()
    order = []
    for _ in range(10):
        b = compose(pending, LIMITS, held, rotation)
        (room,) = set(rooms_of(b))
        order.append(room)
        held.add(room)  # 50 unconfirmed: held until confirmed
        if len(held) > 3:
            held.discard(order[-4])  # the receiver confirms an older room
    assert sorted(order) == rooms


def test_one_room_takes_the_plain_path() -> None:
    run = pdus("!one", 120)
    a, b = pending_of(run), pending_of(run)
    assert compose(a, LIMITS, set(), RoomRotation()) == take_batch(b, LIMITS)
    assert list(a.pdus) == list(b.pdus)
    assert a.pdus.single_room() == "!one"


def test_a_room_stops_at_its_first_pdu_over_the_byte_budget() -> None:
    limits = Limits(max_bytes=10_000)
    big = pdus("!a", 1, size=6_000) + pdus("!a", 1, size=6_000) + pdus("!a", 3, size=100)
    small = pdus("!b", 10, size=100)
    pending = pending_of(big, small)
    b = compose(pending, limits, set(), RoomRotation())
    got_a = [p for p in b.pdus if p.room_id == "!a"]
    assert got_a == [big[0]]  # the second does not fit: none of !a after it either
    assert [p for p in b.pdus if p.room_id == "!b"] == list(small)
    assert b.size_bytes <= limits.max_bytes


def test_rooms_past_the_scan_limit_wait_for_the_head() -> None:
    backlog = pdus("!big", SCAN_LIMIT)
    late = pdus("!late", 1)
    pending = pending_of(backlog, late)
    b = compose(pending, LIMITS, {"!big"}, RoomRotation())
    assert not b.pdus  # bounded work per transaction


@settings(max_examples=200, deadline=None)
@given(
    counts=st.lists(st.integers(1, 80), min_size=1, max_size=6),
    held=st.sets(st.integers(0, 5)),
    interleave=st.booleans(),
    sizes=st.sampled_from([100, 3_000, 30_000]),
)
def test_composed_transactions_keep_order_limits_and_serve_every_room(
    counts: list[int], held: set[int], interleave: bool, sizes: int,
) -> None:
    rooms = [f"!r{i}" for i in range(len(counts))]
    held_rooms = {rooms[i] for i in held if i < len(rooms)}
    limits = Limits(max_bytes=200_000)
    if interleave:
        items: list[PduItem] = []
        left = dict(zip(rooms, counts, strict=True))
        while any(left.values()):
            for r in rooms:
                if left[r]:
                    items.extend(pdus(r, 1, sizes))
                    left[r] -= 1
        pending = pending_of(tuple(items))
    else:
        pending = pending_of(*[pdus(r, n, sizes) for r, n in zip(rooms, counts, strict=True)])
    expected = {r: [p for p in pending.pdus if p.room_id == r] for r in rooms}
    sent: dict[str, list[PduItem]] = {r: [] for r in rooms}
    rotation = RoomRotation()
    starved: dict[str, int] = {}
    while True:
        sendable = {r for r in rooms if r not in held_rooms
                    and len(sent[r]) < len(expected[r])}
        b = compose(pending, limits, held_rooms, rotation)
        if not sendable:
            assert not b.pdus
            break
        assert b.pdus and len(b.pdus) <= limits.max_pdus
        assert b.size_bytes <= limits.max_bytes or len(b.pdus) == 1
        for p in b.pdus:
            assert p.room_id not in held_rooms
            sent[p.room_id].append(p)
        got = set(rooms_of(b))
        for r in sendable:
            starved[r] = 0 if r in got else starved.get(r, 0) + 1
            assert starved[r] <= len(rooms), ("a room starves", r)
    for r in rooms:
        if r in held_rooms:
            assert not sent[r]
        else:
            assert sent[r] == expected[r]  # complete, each room in its own order
    assert len(pending.pdus) == sum(len(expected[r]) for r in held_rooms)


def test_a_room_with_few_pdus_is_live() -> None:
    assert LIVE_ROOM_PDUS == 5
    few = pdus("!few", LIVE_ROOM_PDUS)
    pending = pending_of(pdus("!big", 300), few)
    b = compose(pending, LIMITS, set(), RoomRotation())
    assert {p.event_id for p in few} <= {p.event_id for p in b.pdus}
