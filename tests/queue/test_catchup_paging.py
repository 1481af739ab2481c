"""A room's long gap is replayed whole, a page at a time (queue/core/catchup.py, issue 33
item 2), with the default settings, and a crash in the middle of it loses nothing.

The receiver is the fake homeserver over real HTTP (it does not serve GET /event, so
the queue sends unpaced; tests/synapse/test_catchup_pacing.py has real receivers).
"""

from __future__ import annotations

from collections import Counter

from federation_sender.queue.core.catchup import GAP_PAGE_EVENTS
from federation_sender.storage import destinations as dst
from federation_sender.testing.queue_harness import ALICE, Harness, room_with
from federation_sender.testing.waiting import wait_until
from federation_sender.transport.result import EventHeld, SendResult, Transaction

D = "r1.test"
BOB = f"@bob:{D}"


async def _outage(h: Harness, rows: list[tuple[str, int]], position: int) -> None:
    async with h.engine.begin() as conn:
        await dst.upsert_destination_rooms(conn, [(D, r, so) for r, so in rows])
        await dst.set_last_successful_stream_ordering(conn, D, position)


async def test_a_long_gap_is_replayed_whole_in_order_a_page_at_a_time(hdb: Harness) -> None:
    h = hdb
    w = h.writer
    for room in ("!before:l", "!long:l", "!after:l"):
        await room_with(h, room, D)
    base = w.stream_ordering
    before = await w.messages("!before:l", ALICE, 3)
    ours = await w.messages("!long:l", ALICE, 70)
    # A stretch of the destination's own events (never sent back to it): more than a
    # page with nothing to send, which the read skips.
    theirs = [await w.message("!long:l", BOB, set_extremity=False)
              for _ in range(GAP_PAGE_EVENTS + 10)]
    ours += await w.messages("!long:l", ALICE, 80)
    after = await w.messages("!after:l", ALICE, 2)
    await _outage(h, [("!before:l", before[-1].stream_ordering),
                      ("!long:l", ours[-1].stream_ordering),
                      ("!after:l", after[-1].stream_ordering)], base)
    await h.start()
    assert await h.m.wake_due_destinations() == 1
    await h.settle()
    got = h.fake.received_event_ids(D)
    want = [e.event_id for e in before + ours + after]
    assert sorted(got) == sorted(want)  # each once, none of theirs, no extremity alone
    assert not {e.event_id for e in theirs} & set(got)
    long_ids = {e.event_id for e in ours}
    assert [e for e in got if e in long_ids] == [e.event_id for e in ours]  # stream order
    # One page per transaction at most, so that pacing confirms each before the next.
    per_txn = [sum(1 for e in t.event_ids if e in long_ids) for t in h.fake.accepted(D)]
    assert max(per_txn) <= GAP_PAGE_EVENTS and sum(per_txn) == len(ours)
    row = await h.dest_row(D)
    assert row.last_successful_stream_ordering == after[-1].stream_ordering


async def test_a_crash_in_the_middle_of_a_long_gap_loses_nothing(hdb: Harness) -> None:
    h = hdb
    w = h.writer
    for room in ("!long:l", "!after:l"):
        await room_with(h, room, D)
    base = w.stream_ordering
    ours = await w.messages("!long:l", ALICE, 4 * GAP_PAGE_EVENTS)
    after = await w.messages("!after:l", ALICE, 2)
    await _outage(h, [("!long:l", ours[-1].stream_ordering),
                      ("!after:l", after[-1].stream_ordering)], base)
    h.fake.behave(D, delay_s=0.3)  # real time: a page takes that long to be answered
    await h.start()
    await h.m.wake_due_destinations()
    await wait_until(lambda: len(h.fake.accepted(D)), "the first page delivered",
                     accept=lambda n: n >= 1, timeout_s=10)
    await h.m.stop(0.0)  # crash-like: the page in flight cancelled, nothing flushed
    got = h.fake.received_event_ids(D)
    assert 0 < len(got) < len(ours)
    row = await h.dest_row(D)
    # The episode did not end: the position stays where the outage left it.
    assert row.last_successful_stream_ordering == base
    h.fake.behave(D)
    m2 = await h.start()
    await m2.wake_due_destinations()
    await h.settle()
    got = h.fake.received_event_ids(D)
    assert set(got) == {e.event_id for e in ours + after}
    assert max(Counter(got).values()) <= 2  # the first pages again, nothing more
    row = await h.dest_row(D)
    assert row.last_successful_stream_ordering == after[-1].stream_ordering


class Holding:
    """The harness's sender; ``event_persisted`` answers YES for an event the fake
    homeserver received or that ``before`` holds (sent before a crash)."""

    def __init__(self, h: Harness, before: set[str]) -> None:
        self.inner = h.sender
        self.fake = h.fake
        self.before = before
        self.asked: list[str] = []

    async def send_transaction(self, txn: Transaction) -> SendResult:
        return await self.inner.send_transaction(txn)

    async def event_persisted(self, destination: str, event_id: str) -> EventHeld:
        self.asked.append(event_id)
        held = self.before | set(self.fake.received_event_ids(destination))
        return EventHeld.YES if event_id in held else EventHeld.NOT_YET


async def test_a_page_the_receiver_already_holds_is_not_sent_again(hdb: Harness) -> None:
    """Synapse stages duplicates too, and confirms an event it held before at once:
    a replay of pages it holds (after a crash in the middle of a catch-up) would fill
    its staging queue. So a page whose newest event it holds is skipped."""
    h = hdb
    w = h.writer
    await room_with(h, "!long:l", D)
    base = w.stream_ordering
    ours = await w.messages("!long:l", ALICE, 3 * GAP_PAGE_EVENTS)
    await _outage(h, [("!long:l", ours[-1].stream_ordering)], base)
    probe = Holding(h, {e.event_id for e in ours[:GAP_PAGE_EVENTS]})
    h.sender = probe  # type: ignore[assignment]
    await h.start()
    await h.m.wake_due_destinations()
    await h.settle()
    got = h.fake.received_event_ids(D)
    assert got == [e.event_id for e in ours[GAP_PAGE_EVENTS:]]  # the first page skipped
    assert ours[GAP_PAGE_EVENTS - 1].event_id in probe.asked
    row = await h.dest_row(D)
    assert row.last_successful_stream_ordering == ours[-1].stream_ordering


class Unconfirmed:
    """The harness's sender; ``event_persisted`` answers NOT_YET until ``confirm``, then
    YES for what the fake homeserver holds."""

    def __init__(self, h: Harness) -> None:
        self.h = h
        self.inner = h.sender
        self.confirm = False

    async def send_transaction(self, txn: Transaction) -> SendResult:
        result: SendResult = await self.inner.send_transaction(txn)
        return result

    async def event_persisted(self, destination: str, event_id: str) -> EventHeld:
        held = self.confirm and event_id in self.h.fake.received_event_ids(destination)
        return EventHeld.YES if held else EventHeld.NOT_YET


async def test_a_long_gap_waiting_for_its_confirmation_holds_back_no_other_room(
    hdb: Harness,
) -> None:
    """Issue #44: while a room's long gap waits for the receiver to confirm a page, the
    queue reads the other rooms' rows beside it (their gaps and the event that arrives
    meanwhile go out), then finishes the long gap; each event once, each room in
    order, and the position moves only at the end."""
    h = hdb
    w = h.writer
    for room in ("!long:l", "!long2:l", "!after:l", "!new:l"):
        await room_with(h, room, D)
    base = w.stream_ordering
    ours = await w.messages("!long:l", ALICE, 3 * GAP_PAGE_EVENTS)
    # A second long gap: paged through beside the first, then met again by the main
    # read, which must send none of it twice.
    ours2 = await w.messages("!long2:l", ALICE, 2 * GAP_PAGE_EVENTS + 10)
    after = await w.messages("!after:l", ALICE, 3)
    await _outage(h, [("!long:l", ours[-1].stream_ordering),
                      ("!long2:l", ours2[-1].stream_ordering),
                      ("!after:l", after[-1].stream_ordering)], base)
    probe = Unconfirmed(h)
    h.sender = probe  # type: ignore[assignment]
    await h.start()
    await h.m.wake_due_destinations()
    long_ids = {e.event_id for e in ours}
    await wait_until(lambda: set(h.fake.received_event_ids(D)) >= {e.event_id for e in after},
                     "the other room's gap, beside the waiting one", timeout_s=10)
    assert len(long_ids & set(h.fake.received_event_ids(D))) == GAP_PAGE_EVENTS
    # An event arrives meanwhile (in catch-up mode it is not queued, only recorded).
    new = await w.message("!new:l", ALICE)
    async with h.engine.begin() as conn:
        await dst.upsert_destination_rooms(conn, [(D, "!new:l", new.stream_ordering)])
    h.poke()
    await wait_until(lambda: new.event_id in h.fake.received_event_ids(D),
                     "the new room's event, beside the waiting one", timeout_s=10)
    row = await h.dest_row(D)
    assert row.last_successful_stream_ordering == base  # the episode is not over
    probe.confirm = True
    await h.advance(2.0)
    await wait_until(lambda: set(h.fake.received_event_ids(D)) >= long_ids,
                     "the long gap, once confirmed", timeout_s=10)
    await h.settle()
    await wait_until(lambda: set(h.fake.received_event_ids(D)) >= {e.event_id for e in ours2},
                     "the second long gap", timeout_s=10)
    await h.settle()
    got = h.fake.received_event_ids(D)
    want = [e.event_id for e in ours + ours2 + after] + [new.event_id]
    assert sorted(got) == sorted(want)  # each once
    assert [e for e in got if e in long_ids] == [e.event_id for e in ours]
    long2 = {e.event_id for e in ours2}
    assert [e for e in got if e in long2] == [e.event_id for e in ours2]
    row = await h.dest_row(D)
    assert row.last_successful_stream_ordering >= new.stream_ordering
