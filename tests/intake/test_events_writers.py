"""The events stream with two writers, through the replication handler to the intake and
real queues (native schema, loopback HTTP): an event whose stream ordering was taken
before the other writer's but committed after them is sent, once, in stream order."""

from __future__ import annotations

from federation_sender.storage.backend import NativeBackend
from federation_sender.testing.intake import native_intake
from federation_sender.testing.queue_harness import ALICE, ME, Harness, room_with
from federation_sender.testing.replication import InMemoryPositionStore

ROOM = "!a:l"
DEST = "r1.test"


async def test_late_commit_by_the_other_writer_is_not_skipped(h: Harness) -> None:
    await room_with(h, ROOM, DEST)
    await h.start()
    handler = native_intake(
        h.m, NativeBackend(h.engine), ME, h.clock, event_writers=("p1", "p2")
    )
    await handler.prepare()
    base = h.writer.stream_ordering
    for w in ("p1", "p2"):
        await handler.on_rows("events", w, base, [])  # both announce where they are

    # p2 takes base+1 and is slow to commit it; p1 commits base+2..base+4 meanwhile.
    h.writer.stream_ordering = base + 1
    later = [await h.writer.message(ROOM, ALICE) for _ in range(3)]
    for e in later:
        await handler.on_rows("events", "p1", e.stream_ordering, [])
    await h.settle()
    assert h.fake.received_event_ids(DEST) == []  # base+1 may still come: wait
    assert h.m.events_position == base

    h.writer.stream_ordering = base
    late = await h.writer.message(ROOM, ALICE)
    h.writer.stream_ordering = later[-1].stream_ordering
    await handler.on_rows("events", "p2", late.stream_ordering, [])
    await h.settle()
    expected = [late.event_id, *(e.event_id for e in later)]
    assert h.fake.received_event_ids(DEST) == expected
    assert h.m.events_position == later[-1].stream_ordering


async def test_idle_writer_releases_with_its_position(h: Harness) -> None:
    """p2 writes nothing; p1's events (with a gap in the sequence, so no gapless run)
    wait until p2's POSITION says it has caught up to them."""
    await room_with(h, ROOM, DEST)
    await h.start()
    handler = native_intake(
        h.m, NativeBackend(h.engine), ME, h.clock, event_writers=("p1", "p2")
    )
    await handler.prepare()
    base = h.writer.stream_ordering
    await handler.on_rows("events", "p2", base, [])
    h.writer.stream_ordering = base + 1  # an ordering taken and never used
    e = await h.writer.message(ROOM, ALICE)
    await handler.on_rows("events", "p1", e.stream_ordering, [])
    await h.settle()
    assert h.fake.received_event_ids(DEST) == []
    await handler.on_rows("events", "p2", e.stream_ordering, [])  # POSITION events p2
    await h.settle()
    assert h.fake.received_event_ids(DEST) == [e.event_id]


async def test_one_writer_unconfigured_is_its_token(h: Harness) -> None:
    """The simulator's shape: no configured list, one writer."""
    await room_with(h, ROOM, DEST)
    await h.start()
    handler = native_intake(h.m, NativeBackend(h.engine), ME, h.clock)
    await handler.prepare()
    evs = [await h.writer.message(ROOM, ALICE) for _ in range(3)]
    await handler.on_rows("events", "master", evs[-1].stream_ordering, [])
    await h.settle()
    assert h.fake.received_event_ids(DEST) == [e.event_id for e in evs]


async def test_restart_while_a_writer_is_down(h: Harness) -> None:
    """p2 is down (stored at the intake's position); p1 wrote three events before our
    restart and is stored past them. Its next event must not wait for p2: the committed
    stream orderings read at start bridge the gap, as Synapse's generator does."""
    await room_with(h, ROOM, DEST)
    await h.start()
    base = h.m.events_position
    before = [await h.writer.message(ROOM, ALICE) for _ in range(3)]
    stored = InMemoryPositionStore(
        {("events", "p1"): before[-1].stream_ordering, ("events", "p2"): base}
    )
    handler = native_intake(
        h.m, NativeBackend(h.engine), ME, h.clock, event_writers=("p1", "p2"),
        stored_positions=stored,
    )  # fmt: skip
    await handler.prepare()
    after = await h.writer.message(ROOM, ALICE)
    await handler.on_rows("events", "p1", after.stream_ordering, [])
    await h.settle()
    assert h.fake.received_event_ids(DEST) == [e.event_id for e in (*before, after)]
