"""New queues read their rows together (``QueuePersistence.bootstrap_gathered``): one
message in a room of many servers starts a queue for each, and their first reads share
a few database transactions, each queue still getting its own row and outbox."""

from __future__ import annotations

from federation_sender.storage import destinations as dst
from federation_sender.testing.queue_harness import ALICE, Harness, room_with

REMOTES = [f"r{i:02d}.test" for i in range(40)]
BACKING_OFF = REMOTES[0]
WITH_OUTBOX = REMOTES[1]


async def test_a_room_of_40_servers_starts_its_queues_in_one_or_two_reads(h: Harness) -> None:
    await room_with(h, "!big:l", *REMOTES)
    await h.writer.to_device(WITH_OUTBOX, {"message_id": "td"})
    now_ms = int(h.clock.time_s() * 1000)
    async with h.engine.begin() as conn:
        await dst.ensure_destinations(conn, REMOTES)
        await dst.set_retry_timings(conn, BACKING_OFF, now_ms, now_ms, 600_000)
    await h.start()
    store = h.m.store
    reads_before = store.gathered_reads
    e = await h.writer.message("!big:l", ALICE)
    h.poke()
    await h.settle()

    # Every queue started by that hand-over read in one gathered transaction (two if
    # the first began before the last queue asked); never one per queue.
    assert 1 <= store.gathered_reads - reads_before <= 2
    for r in REMOTES[1:]:
        assert h.fake.received_event_ids(r) == [e.event_id], r
    # Its own row: still backing off, so nothing was attempted.
    assert BACKING_OFF not in h.fake.attempts
    st = h.m.status(BACKING_OFF)
    assert st is not None and st.next_retry_ts_ms is not None
    # Its own outbox: the to-device message went with the event; nobody else got it.
    assert [x["content"] for x in h.fake.received_edus(WITH_OUTBOX)] == [{"message_id": "td"}]
    assert all(not h.fake.received_edus(r) for r in REMOTES[2:])
    # What the metrics export (federation_sender_queue_first_reads_total and the
    # group-commit counters): 39 results written in at most a few commits.
    snap = h.m.snapshot()
    assert snap.first_reads == store.gathered_reads
    assert snap.group_commit_results >= 39 and 1 <= snap.group_commits <= snap.group_commit_results
