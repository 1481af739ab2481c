"""A position lowered by another process (``batch audit --repair``) while the
destination's queue is live: the queue's own writes must not raise it again, and the
wake-up sweep must make the queue send what is past it."""

from __future__ import annotations

import itertools
import random

from sqlalchemy import text

from federation_sender.queue.core.backoff import RESET, BackoffPolicy
from federation_sender.queue.core.batching import Limits
from federation_sender.queue.core.destination import DestinationCore
from federation_sender.queue.core.loop_policy import LoopPolicy
from federation_sender.testing.queue_harness import ALICE, Harness, room_with

D = "r1.test"


async def lower(h: Harness, position: int) -> None:
    """What ``audit --repair`` does to ``destinations`` (storage/synapse/batch_apply.py)."""
    async with h.engine.begin() as conn:
        await conn.execute(
            text("UPDATE destinations SET last_successful_stream_ordering = :p"
                 " WHERE destination = :d AND last_successful_stream_ordering > :p"),
            {"p": position, "d": D},
        )


async def test_a_live_queue_catches_up_from_a_position_a_repair_lowered(h: Harness) -> None:
    await room_with(h, "!a:l", D)
    await h.start()
    base = h.writer.stream_ordering
    e1 = await h.writer.message("!a:l", ALICE)
    h.poke()
    await h.settle()
    assert h.fake.received_event_ids(D) == [e1.event_id]
    assert (await h.dest_row(D)).last_successful_stream_ordering == e1.stream_ordering
    # The queue is still live (idle, not evicted: the clock has not moved) when the
    # repair lowers its position below e1, as if e1 had been found lost.
    assert h.m.status(D) is not None
    await lower(h, base)
    # A new event goes out; its success must not raise the position over the repair's.
    e2 = await h.writer.message("!a:l", ALICE)
    h.poke()
    await h.settle()
    assert h.fake.received_event_ids(D) == [e1.event_id, e2.event_id]
    assert (await h.dest_row(D)).last_successful_stream_ordering == base
    # The sweep finds rows past the lowered position; the live queue reads it again and
    # sends the room's events past it in catch-up mode.
    assert await h.m.wake_due_destinations() == 1
    await h.settle()
    got = h.fake.received_event_ids(D)
    assert got[:2] == [e1.event_id, e2.event_id]
    assert sorted(got[2:]) == sorted([e1.event_id, e2.event_id])
    assert (await h.dest_row(D)).last_successful_stream_ordering == e2.stream_ordering
    st = h.m.status(D)
    assert st is not None and not st.catching_up
    assert [d for d, _ in h.observer.catchups] == [D]
    # Back to normal sending, and nothing else is owed: the next sweep wakes nobody.
    e3 = await h.writer.message("!a:l", ALICE)
    h.poke()
    await h.settle()
    assert h.fake.received_event_ids(D)[-1] == e3.event_id
    assert (await h.dest_row(D)).last_successful_stream_ordering == e3.stream_ordering
    assert await h.m.wake_due_destinations() == 0


async def test_a_sweep_that_read_our_own_position_costs_no_read(h: Harness) -> None:
    """The usual case: the sweep finds a live queue behind (a PDU in flight or not yet
    committed) at the position the queue knows: no recheck, nothing resent."""
    await room_with(h, "!a:l", D)
    await h.start()
    e1 = await h.writer.message("!a:l", ALICE)
    h.poke()
    await h.settle()
    r = h.m.queues.get(D, create=False)
    assert r is not None
    r.swept(e1.stream_ordering)
    assert not r._recheck
    r.swept(e1.stream_ordering - 1)
    assert r._recheck
    await h.settle()
    assert not r._recheck and h.fake.received_event_ids(D) == [e1.event_id]
    assert (await h.dest_row(D)).last_successful_stream_ordering == e1.stream_ordering


def _core(position: int) -> DestinationCore:
    ids = itertools.count()
    c = DestinationCore(D, BackoffPolicy(), Limits(max_pdus=5), random.Random(0),
                        lambda: f"t{next(ids)}", catching_up=False, loop_policy=LoopPolicy())
    c.load(RESET, position)
    return c


def test_position_read_adopts_the_persisted_position() -> None:
    c = _core(10)
    assert c.position_read(10).entered_catchup is False and not c.catching_up
    eff = c.position_read(4)  # lowered: catch up from there
    assert eff.entered_catchup and c.catching_up and c.last_successful == 4
    assert c.episode.cursor[0] <= 4
    c2 = _core(10)
    eff = c2.position_read(12)  # raised by someone else: adopted, no catch-up
    assert not eff.entered_catchup and not c2.catching_up and c2.last_successful == 12
