"""Fuller transactions while the fan-out is behind (``queue/coalesce.py``), and none
held otherwise: with nothing in flight a destination sends at once, and what queues
behind a transaction in flight goes in the next (``queue/core/loop_policy.py``)."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from federation_sender.config import QueueSettings
from federation_sender.queue.coalesce import HandOverGate
from federation_sender.testing.clock import FakeClock
from federation_sender.testing.queue_harness import ALICE, Harness, room_with
from federation_sender.testing.waiting import wait_until


async def test_a_hand_over_releases_every_waiting_queue_once() -> None:
    gate = HandOverGate(FakeClock(), max_hold_s=0.5)
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
    gate = HandOverGate(clock, max_hold_s=0.5)
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
    # One event per fan-out batch: without the gate, every event would leave alone as
    # soon as it was handed over while the fan-out reads the next.
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
    ``max_hold_s`` from its first wait; a full batch or a caught-up fan-out ends it."""
    clock = FakeClock()
    gate = HandOverGate(clock, max_hold_s=0.5)
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


async def _messages(h: Harness, n: int) -> list[str]:
    ids = [(await h.writer.message("!a:l", ALICE)).event_id for _ in range(n)]
    h.poke()
    await h.settle()
    return ids


async def test_a_steady_stream_sends_each_pdu_at_once_when_nothing_is_in_flight(
    h: Harness,
) -> None:
    # The defaults. The former steady-stream hold (queue.busy_txn_interval_s 2 s,
    # busy_min_pdus 20) held the 21st PDU within 2 s for up to 2 s; the clock does not
    # move here, so each PDU must go as soon as it is handed over.
    h.settings = replace(QueueSettings(), wakeup_interval_s=60.0)
    await room_with(h, "!a:l", "r1.test")
    await h.start()
    sent: list[str] = []
    for _ in range(30):
        sent += await _messages(h, 1)
        assert h.fake.received_event_ids("r1.test") == sent
    sizes = [n for d, _o, _s, n, _e in h.observer.sent if d == "r1.test"]
    assert sizes == [1] * 30


async def test_what_queues_behind_a_transaction_in_flight_goes_all_in_the_next(
    h: Harness,
) -> None:
    h.settings = replace(QueueSettings(), wakeup_interval_s=60.0, max_pdus_per_txn=5)
    await room_with(h, "!a:l", "r1.test")
    await h.start()
    await h.settle()
    n0 = h.fake.requests
    h.fake.behave("r1.test", hang=True)
    first = (await h.writer.message("!a:l", ALICE)).event_id
    h.poke()
    await wait_until(lambda: h.fake.requests > n0, "the first request is in flight",
                     timeout_s=10)
    behind = [(await h.writer.message("!a:l", ALICE)).event_id for _ in range(7)]
    h.poke()
    await wait_until(lambda: (s := h.m.status("r1.test")) is not None
                     and s.pending_pdus == 8, "seven more queued", timeout_s=10)
    h.fake.behave("r1.test")
    h.fake.release()
    await h.settle()
    assert h.fake.received_event_ids("r1.test") == [first, *behind]
    sizes = [n for d, _o, _s, n, _e in h.observer.sent if d == "r1.test"]
    assert sizes == [1, 5, 2]  # the next takes all it may; the rest right behind it
