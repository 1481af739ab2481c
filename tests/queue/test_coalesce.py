"""Fuller transactions while the intake is behind (``queue/coalesce.py``)."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from federation_sender.config import QueueSettings
from federation_sender.queue.coalesce import IntakeGate
from federation_sender.testing.clock import FakeClock
from federation_sender.testing.queue_harness import ALICE, Harness, room_with


async def test_a_hand_over_releases_every_waiting_queue_once() -> None:
    gate = IntakeGate(FakeClock(), max_hold_s=0.5)
    gate.behind = True
    waiters = [asyncio.ensure_future(gate.wait_for_hand_over()) for _ in range(3)]
    await asyncio.sleep(0)
    assert not any(w.done() for w in waiters)
    gate.handed_over()
    await asyncio.gather(*waiters)
    later = asyncio.ensure_future(gate.wait_for_hand_over())  # waits for the next one
    await asyncio.sleep(0)
    assert not later.done()
    gate.set_behind(False)  # caught up: nobody waits for a hand-over that will not come
    await later
    assert gate.holds == 4


async def test_a_stalled_intake_holds_a_queue_only_max_hold_s() -> None:
    clock = FakeClock()
    gate = IntakeGate(clock, max_hold_s=0.5)
    gate.behind = True
    w = asyncio.ensure_future(gate.wait_for_hand_over())
    for _ in range(3):
        await asyncio.sleep(0)  # the waiter runs and arms the timer at t = 0
    await clock.advance_and_settle(0.4)
    assert not w.done()
    await clock.advance_and_settle(0.1)
    assert w.done()
    gate.close()


async def test_queues_wait_for_the_intake_and_send_fuller_transactions(h: Harness) -> None:
    # One event per intake batch: without the gate, every event would leave alone as
    # soon as it was handed over while the intake reads the next.
    h.settings = replace(QueueSettings(), event_batch_size=1, wakeup_interval_s=60.0)
    await room_with(h, "!a:l", "r1.test")
    await h.start()
    first = await h.writer.message("!a:l", ALICE)
    h.poke()
    await h.settle()  # the queue exists and is idle
    events = [await h.writer.message("!a:l", ALICE) for _ in range(10)]
    h.poke()
    await h.settle()
    got = h.fake.received_event_ids("r1.test")
    assert got == [first.event_id] + [e.event_id for e in events]  # all, in order, once
    sizes = [n for d, _o, _s, n, _e in h.observer.sent if d == "r1.test"][1:]
    assert sum(sizes) == 10
    assert h.m.gate is not None and h.m.gate.holds >= 1
    assert max(sizes) >= 2 and len(sizes) < 10


async def test_without_the_gate_nothing_waits(h: Harness) -> None:
    h.settings = replace(QueueSettings(), coalesce_hold_s=0.0, wakeup_interval_s=60.0)
    await room_with(h, "!a:l", "r1.test")
    await h.start()
    assert h.m.gate is None
    e = await h.writer.message("!a:l", ALICE)
    h.poke()
    await h.settle()
    assert h.fake.received_event_ids("r1.test") == [e.event_id]


async def test_a_hold_lasts_over_hand_overs_until_full_or_max_hold_s() -> None:
    """Hand-overs that leave the batch part-filled keep the queue waiting, up to
    ``max_hold_s`` from its first wait; a full batch or a caught-up intake ends it."""
    clock = FakeClock()
    gate = IntakeGate(clock, max_hold_s=0.5)
    gate.behind = True
    full = False
    held = asyncio.ensure_future(gate.hold(lambda: not full))
    await clock.advance_and_settle(0)  # it starts waiting at t = 0
    for step in range(4):  # hand-overs at 0.1, 0.2, 0.3, 0.4 s: still part-filled
        await clock.advance_and_settle(0.1)
        gate.handed_over()
        await clock.advance_and_settle(0)
        assert not held.done(), step
    await clock.advance_and_settle(0.1)
    gate.handed_over()  # 0.5 s: the hold is over
    await clock.advance_and_settle(0)
    assert held.done()

    held = asyncio.ensure_future(gate.hold(lambda: not full))
    await clock.advance_and_settle(0.1)
    full = True
    gate.handed_over()
    await clock.advance_and_settle(0)
    assert held.done()

    full = False
    held = asyncio.ensure_future(gate.hold(lambda: not full))
    await clock.advance_and_settle(0.1)
    gate.set_behind(False)
    await clock.advance_and_settle(0)
    assert held.done()
    gate.close()


def _busy(h: Harness, **kw: object) -> None:
    h.settings = replace(QueueSettings(), coalesce_hold_s=0.0, wakeup_interval_s=60.0,
                         busy_txn_interval_s=1.0, busy_min_pdus=3, max_pdus_per_txn=5,
                         **kw)  # type: ignore[arg-type]


async def _messages(h: Harness, n: int) -> list[str]:
    ids = [(await h.writer.message("!a:l", ALICE)).event_id for _ in range(n)]
    h.poke()
    await h.settle()
    return ids


async def _steady_stream(h: Harness) -> list[str]:
    """A started harness whose one destination (r1.test) is in a steady stream at the
    clock's start: one quiet PDU, then four (>= 3 within the interval); returns those
    four."""
    _busy(h)
    await room_with(h, "!a:l", "r1.test")
    await h.start()
    await _messages(h, 1)
    return await _messages(h, 4)


@pytest.mark.parametrize("intake_gate", [False, True])
async def test_a_steady_stream_sends_at_most_one_part_filled_transaction_per_interval(
    h: Harness, intake_gate: bool
) -> None:
    # With the gate and one event per intake batch, the queue first holds for the
    # intake's hand-overs, whose pokes must not end the hold for the interval.
    _busy(h)
    if intake_gate:
        h.settings = replace(h.settings, coalesce_hold_s=0.5, event_batch_size=1)
    await room_with(h, "!a:l", "r1.test")
    await h.start()
    quiet = await _messages(h, 1)
    assert h.fake.received_event_ids("r1.test") == quiet  # one PDU: sent at once
    stream = await _messages(h, 4)
    assert h.fake.received_event_ids("r1.test") == quiet + stream  # not busy before
    held = await _messages(h, 2)
    # Five PDUs (>= 3) within the interval: a steady stream; the next part-filled
    # transaction waits for the interval to end.
    assert h.fake.received_event_ids("r1.test") == quiet + stream
    status = h.m.status("r1.test")
    assert status is not None and status.pending_pdus == 2
    await h.advance(0.5)
    assert h.fake.received_event_ids("r1.test") == quiet + stream
    await h.advance(0.5)  # one interval after the first of them started
    assert h.fake.received_event_ids("r1.test") == quiet + stream + held
    # A new interval began with those 2 PDUs: below 3, nothing waits.
    after = await _messages(h, 1)
    assert h.fake.received_event_ids("r1.test") == quiet + stream + held + after
    sizes = [n for d, _o, _s, n, _e in h.observer.sent if d == "r1.test"]
    assert sizes[-4:] == [1, 4, 2, 1]


async def test_a_full_batch_and_a_stop_do_not_wait_for_the_interval(h: Harness) -> None:
    stream = await _steady_stream(h)
    full = await _messages(h, 5)  # fills a transaction: sent without waiting
    assert h.fake.received_event_ids("r1.test")[-9:] == stream + full
    backlog = await _messages(h, 12)  # 5 and 5 at once, the last 2 at the interval's end
    assert h.fake.received_event_ids("r1.test")[-10:] == backlog[:10]
    await h.advance(1.0)
    assert h.fake.received_event_ids("r1.test")[-12:] == backlog
    sizes = [n for d, _o, _s, n, _e in h.observer.sent if d == "r1.test"]
    assert sizes[-5:] == [4, 5, 5, 5, 2]
    # Busy again, and a stop during the hold ends it at once (the PDU stays owed).
    await _messages(h, 4)
    await _messages(h, 1)
    status = h.m.status("r1.test")
    assert status is not None and status.pending_pdus == 1
    await asyncio.wait_for(h.m.stop(5.0), 5.0)  # real time: the fake clock stands still


async def test_the_hold_counts_from_the_last_send_not_the_interval_start(h: Harness) -> None:
    # A batch that filled late in an interval: what follows it waits a whole interval
    # from that send (and can fill too), not only until the old interval's end.
    await _steady_stream(h)  # t = 0
    await h.advance(0.6)
    full = await _messages(h, 5)  # a full batch at t = 0.6: sent at once
    assert h.fake.received_event_ids("r1.test")[-5:] == full
    held = await _messages(h, 2)
    await h.advance(0.4)  # t = 1.0, the end of the interval that began at 0
    assert h.fake.received_event_ids("r1.test")[-5:] == full
    await h.advance(0.6)  # t = 1.6: one interval after the full batch
    assert h.fake.received_event_ids("r1.test")[-7:] == full + held
    sizes = [n for d, _o, _s, n, _e in h.observer.sent if d == "r1.test"]
    assert sizes[-3:] == [4, 5, 2]


async def test_in_a_steady_stream_an_overfilled_batch_leaves_its_remainder_waiting(
    h: Harness,
) -> None:
    # One hand-over brings more than a transaction holds: the full one leaves at once,
    # and the remainder waits like any part-filled transaction of the stream instead
    # of going out near empty right behind it.
    await _steady_stream(h)  # t = 0
    await h.advance(0.5)
    burst = await _messages(h, 7)  # during the hold: 5 go at once, 2 are left
    assert h.fake.received_event_ids("r1.test")[-5:] == burst[:5]
    await h.advance(0.9)
    assert h.fake.received_event_ids("r1.test")[-5:] == burst[:5]
    await h.advance(0.1)  # one interval after the full batch
    assert h.fake.received_event_ids("r1.test")[-7:] == burst
    sizes = [n for d, _o, _s, n, _e in h.observer.sent if d == "r1.test"]
    assert sizes[-3:] == [4, 5, 2]


async def test_a_burst_after_a_quiet_spell_sends_its_tail_at_once(h: Harness) -> None:
    await _steady_stream(h)  # t = 0, then nothing
    await h.advance(10.0)
    late = await _messages(h, 7)  # a backlog, not the stream's: 5 and 2 at once
    assert h.fake.received_event_ids("r1.test")[-7:] == late


async def test_an_edu_only_transaction_does_not_move_the_streams_clock(h: Harness) -> None:
    stream = await _steady_stream(h)  # t = 0
    await h.advance(0.6)
    h.m.enqueue_edu("r1.test", "m.typing", {"room_id": "!a:l"}, key="!a:l")
    await h.settle()
    edus = [e for d, _o, _s, _n, e in h.observer.sent if d == "r1.test"]
    assert edus[-1] == 1  # an EDU-only transaction: nothing held it
    held = await _messages(h, 2)
    await h.advance(0.4)  # t = 1.0: one interval after the stream's last PDUs
    assert h.fake.received_event_ids("r1.test")[-6:] == stream + held
