"""Catch-up, restarts, wake-ups and the federation stream over real HTTP."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import pytest
from sqlalchemy import select

from federation_sender.queue.core.states import DestinationState
from federation_sender.queue.federation_stream import FederationEdu
from federation_sender.storage import destinations as dst
from federation_sender.storage import schema as s
from federation_sender.storage.positions import FEDERATION_STREAM
from federation_sender.testing.queue_harness import (
    ALICE,
    Harness,
    room_with,
)
from federation_sender.testing.waiting import wait_until

D = "r1.test"


async def fail_until_catchup(h: Harness) -> int:
    """Let D fail until its backoff passes an hour; returns the number of attempts."""
    for n in range(1, 20):
        st = h.m.status(D)
        assert st is not None
        if st.catching_up:
            return n
        assert st.next_retry_ts_ms is not None
        await h.advance(st.next_retry_ts_ms / 1000 - h.clock.time_s())
    raise AssertionError("never switched to catch-up")


async def test_one_hour_switch_to_catchup_then_replay_in_order(h: Harness) -> None:
    await room_with(h, "!a:l", D)
    h.without_short_retry()  # the persisted backoff at the first failure
    await room_with(h, "!b:l", D)
    await h.start()
    h.fake.behave(D, status=503)
    first = await h.writer.message("!a:l", ALICE)
    h.poke()
    await h.settle()
    h.m.enqueue_edu(D, "m.typing", {"room_id": "!a:l"}, key="!a:l")
    await h.writer.to_device(D, {"message_id": "td1"})
    h.m.notify_outbox(D)
    await fail_until_catchup(h)
    st = h.m.status(D)
    assert st is not None and st.retry_interval_ms > 3_600_000
    # Dropped from memory: the PDU and the typing EDU. The to-device message is durable
    # (its outbox row), and catch-up reads the outbox again: whether that read has
    # happened yet depends on timing, so it may be back in memory (it is sent below).
    assert st.pending_pdus == 0 and st.pending_edus <= 1
    assert h.observer.catchups and h.observer.catchups[0][0] == D
    # More events arrive meanwhile: not queued in memory, but not lost either.
    later = [await h.writer.message(r, ALICE) for r in ("!b:l", "!a:l", "!b:l")]
    h.poke()
    await h.settle()
    assert h.m.status(D).pending_pdus == 0  # type: ignore[union-attr]
    h.fake.behave(D)
    await h.advance(st.next_retry_ts_ms / 1000 - h.clock.time_s())  # type: ignore[operator]
    got = h.fake.received_event_ids(D)
    assert sorted(got) == sorted([first.event_id] + [e.event_id for e in later])
    # Within a room, oldest first.
    a = [e for e in got if e in (first.event_id, later[1].event_id)]
    assert a == [first.event_id, later[1].event_id]
    edus = [e["edu_type"] for e in h.fake.received_edus(D)]
    assert "m.direct_to_device" in edus and "m.typing" not in edus
    assert all(t.txn_id for t in h.fake.accepted(D))
    log = await h.txlog(D)
    assert any(r.catchup for r in log)
    st = h.m.status(D)
    assert st is not None and not st.catching_up
    row = await h.dest_row(D)
    assert row.last_successful_stream_ordering == later[-1].stream_ordering
    # Back to normal sending.
    nxt = await h.writer.message("!a:l", ALICE)
    h.poke()
    await h.settle()
    assert h.fake.received_event_ids(D)[-1] == nxt.event_id


async def outage(h: Harness, rows: list[tuple[str, int]], position: int) -> None:
    async with h.engine.begin() as conn:
        await dst.upsert_destination_rooms(conn, [(D, r, so) for r, so in rows])
        await dst.set_last_successful_stream_ordering(conn, D, position)


async def test_catchup_selects_extremities_or_the_event_in_partial_state_rooms(
    h: Harness,
) -> None:
    h.settings = replace(h.settings, catchup_max_gap_events=50)  # 60 events: a long gap
    w = h.writer
    await room_with(h, "!ext:l", D)
    await room_with(h, "!part:l", D)
    await room_with(h, "!short:l", D)
    base = w.stream_ordering
    ext_room = await w.messages("!ext:l", ALICE, 60)
    remote_tip = await w.message("!ext:l", f"@bob:{D}", set_extremity=False)
    await w.set_extremities("!ext:l", [ext_room[-1].event_id, remote_tip.event_id])
    part = await w.messages("!part:l", ALICE, 60)
    await w.mark_partial_state("!part:l")
    short = await w.messages("!short:l", ALICE, 3)
    await outage(h, [("!ext:l", ext_room[-1].stream_ordering),
                     ("!part:l", part[-1].stream_ordering),
                     ("!short:l", short[-1].stream_ordering)], base)
    await h.start()
    assert await h.m.wake_due_destinations() == 1
    await h.settle()
    got = h.fake.received_event_ids(D)
    assert sorted(got) == sorted([ext_room[-1].event_id, remote_tip.event_id,
                                  part[-1].event_id] + [e.event_id for e in short])
    assert all(t.status == 200 for t in h.fake.attempts[D])
    row = await h.dest_row(D)
    assert row.last_successful_stream_ordering == short[-1].stream_ordering


async def test_extremity_the_destination_never_saw_is_not_sent(h: Harness) -> None:
    h.settings = replace(h.settings, catchup_max_gap_events=50)  # 60 events: a long gap
    w = h.writer
    await room_with(h, "!a:l", D)
    base = w.stream_ordering
    evs = await w.messages("!a:l", ALICE, 60)
    await w.membership("!a:l", f"@bob:{D}", "leave", sender=ALICE)
    tip = await w.message("!a:l", ALICE)  # after the kick: not for D
    await outage(h, [("!a:l", evs[-1].stream_ordering)], base)
    await h.start()
    await h.m.wake_due_destinations()
    await h.settle()
    assert h.fake.received_event_ids(D) == [evs[-1].event_id]
    assert tip.event_id not in h.fake.received_event_ids(D)
    async with h.engine.connect() as conn:
        left = (await conn.execute(select(s.destination_rooms))).all()
    assert left == []  # D left the room: pruned


async def test_purged_room_rows_are_pruned_and_do_not_spin(h: Harness) -> None:
    w = h.writer
    await room_with(h, "!gone:l", D)
    await room_with(h, "!ok:l", D)
    base = w.stream_ordering
    gone = await w.message("!gone:l", ALICE)
    ok = await w.message("!ok:l", ALICE)
    await w.purge_room("!gone:l")
    await outage(h, [("!gone:l", gone.stream_ordering), ("!ok:l", ok.stream_ordering)], base)
    await h.start()
    await h.m.wake_due_destinations()
    await h.settle()
    assert h.fake.received_event_ids(D) == [ok.event_id]
    async with h.engine.connect() as conn:
        rooms = (await conn.execute(select(s.destination_rooms.c.room_id))).scalars().all()
    assert rooms == ["!ok:l"]
    assert (await h.dest_row(D)).last_successful_stream_ordering == ok.stream_ordering
    st = h.m.status(D)
    assert st is not None and st.state is DestinationState.IDLE and not st.catching_up


async def test_restart_in_the_middle_of_everything_loses_nothing(hdb: Harness) -> None:
    h = hdb
    h.without_short_retry()  # the persisted backoff at the first failure
    remotes = ["r1.test", "r2.test", "r3.test"]
    rooms = ["!a:l", "!b:l", "!c:l"]
    for r in rooms:
        await room_with(h, r, *remotes)
    await h.start()
    h.fake.behave("r2.test", status=503)  # backing off
    h.fake.behave("r3.test", hang=True)  # in flight at the crash
    sent = []
    for i in range(20):
        sent.append(await h.writer.message(rooms[i % 3], ALICE))
    h.poke()

    def r2_backing_off() -> bool:
        st = h.m.status("r2.test")
        return st is not None and st.retry_interval_ms > 0

    await wait_until(lambda: (h.fake.in_progress, len(h.fake.accepted("r1.test")),
                              r2_backing_off()),
                     "r3 in flight, r1 delivered to and r2 backing off",
                     accept=lambda seen: seen[0] == 1 and seen[1] > 0 and seen[2],
                     timeout_s=10)
    for i in range(15):
        sent.append(await h.writer.message(rooms[i % 2], ALICE))
    h.poke()
    await h.m.stop(0.0)  # crash-like: in-flight cancelled, nothing flushed
    h.fake.behave("r2.test")
    h.fake.behave("r3.test")
    h.fake.release()
    h.clock.advance(7 * 24 * 3600)  # any backoff is over
    m2 = await h.start()
    m2.notify_new_events(h.writer.stream_ordering)
    await h.settle()
    await m2.wake_due_destinations()
    await h.settle()
    for r in remotes:
        got = set(h.fake.received_event_ids(r))
        missing = [e.event_id for e in sent if e.event_id not in got]
        assert not missing, (r, missing)
    # After recovery, every destination is caught up to the end.
    for r in remotes:
        row = await h.dest_row(r)
        assert row.last_successful_stream_ordering == sent[-1].stream_ordering


async def test_wakeups_find_outbox_work_and_skip_backoff(h: Harness) -> None:
    await h.start()
    await h.writer.to_device("r5.test", {"message_id": "x"})
    await h.writer.to_device("r6.test", {"message_id": "y"})
    async with h.engine.begin() as conn:
        await dst.ensure_destinations(conn, ["r5.test", "r6.test"])
        await dst.set_retry_timings(conn, "r6.test", 0, int(h.clock.time_s() * 1000), 600_000)
    assert await h.m.wake_due_destinations() == 1
    await h.settle()
    assert [e["content"] for e in h.fake.received_edus("r5.test")] == [{"message_id": "x"}]
    assert "r6.test" not in h.fake.attempts
    await h.advance(61 * 10)  # the periodic sweep picks r6 up once its backoff is over
    assert [e["content"] for e in h.fake.received_edus("r6.test")] == [{"message_id": "y"}]


async def test_federation_stream_edus_are_queued_and_acknowledged(h: Harness) -> None:
    acks: list[int] = []

    async def ack(token: int) -> None:
        acks.append(token)

    m = await h.start()
    m.set_federation_ack(ack)
    assert m.federation_position is None
    await m.process_federation_batch(7, [
        FederationEdu(D, "m.typing", {"room_id": "!a", "typing": True}, key="!a"),
        FederationEdu(D, "m.presence", {"push": [{"user_id": ALICE, "presence": "online"}]}),
    ])
    await h.settle()
    assert [e["edu_type"] for e in h.fake.received_edus(D)] == ["m.presence", "m.typing"]
    assert acks == [7]
    await m.stop(1.0)
    m2 = await h.start()
    assert m2.federation_position == 7
    async with h.engine.connect() as conn:
        v = (await conn.execute(select(s.stream_positions.c.stream_id).where(
            s.stream_positions.c.stream_name == FEDERATION_STREAM))).scalar()
    assert v == 7


async def test_stop_lets_in_flight_transactions_finish(h: Harness) -> None:
    await room_with(h, "!a:l", D)
    await h.start()
    h.fake.behave(D, delay_s=0.2)
    e = await h.writer.message("!a:l", ALICE)
    h.poke()
    await wait_until(lambda: h.fake.in_progress, "a transaction in flight",
                     accept=lambda n: n == 1, timeout_s=10)
    await h.m.stop(30.0)
    assert h.fake.received_event_ids(D) == [e.event_id]
    assert (await h.dest_row(D)).last_successful_stream_ordering == e.stream_ordering
    assert h.m.statuses() == []


async def test_idle_queues_are_dropped(h: Harness) -> None:
    await room_with(h, "!a:l", D, "r2.test")
    await h.start()
    await h.writer.message("!a:l", ALICE)
    h.poke()
    await h.settle()
    assert h.m.active_queues == 2
    await h.advance(61)
    assert h.m.active_queues == 0
    e = await h.writer.message("!a:l", ALICE)
    h.poke()
    await h.settle()
    assert h.fake.received_event_ids(D)[-1] == e.event_id


async def test_catchup_while_the_intake_commit_is_held_back_loses_nothing(
    hdb: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A queue catches up (after REMOTE_SERVER_UP) while the fan-out's transaction for a
    new event has not committed: catch-up finds no row and ends, and the event, handed
    over only after the commit, is still delivered, and the position lands on it."""
    h = hdb
    h.without_short_retry()  # the persisted backoff at the first failure
    await room_with(h, "!a:l", D)
    await h.start()
    h.fake.behave(D, status=503)
    await h.writer.message("!a:l", ALICE)
    h.poke()
    await h.settle()
    await fail_until_catchup(h)
    h.fake.behave(D)
    release = asyncio.Event()
    held = asyncio.Event()
    real = dst.upsert_destination_rooms

    async def slow_upsert(*a: Any, **kw: Any) -> None:
        held.set()
        await release.wait()
        await real(*a, **kw)

    monkeypatch.setattr(dst, "upsert_destination_rooms", slow_upsert)
    e = await h.writer.message("!a:l", ALICE)
    h.poke()
    await asyncio.wait_for(held.wait(), 10)  # read, rows not yet committed
    await h.m.remote_server_up(D)  # catch-up starts now, while the row is uncommitted

    def episode_over() -> bool:
        st = h.m.status(D)
        return st is not None and not st.catching_up and st.state is DestinationState.IDLE

    await wait_until(episode_over, "catch-up ending without the uncommitted row",
                     timeout_s=10)
    assert e.event_id not in h.fake.received_event_ids(D)
    release.set()
    await h.settle()
    assert h.fake.received_event_ids(D)[-1] == e.event_id
    st = h.m.status(D)
    assert st is not None and not st.catching_up
    assert (await h.dest_row(D)).last_successful_stream_ordering == e.stream_ordering


async def test_settle_waits_for_a_queue_still_bootstrapping(h: Harness) -> None:
    """``settle()`` returns on real quiescence only: a queue still waiting for its first
    read (its row and outbox) is not idle, whatever its state says."""
    await h.start()
    store = h.m.store
    read = store.bootstrap_gathered
    gate = asyncio.Event()
    waiting: list[str] = []

    async def held(destination: str, outbox_limit: int) -> Any:
        waiting.append(destination)
        await gate.wait()
        return await read(destination, outbox_limit)

    store.bootstrap_gathered = held  # type: ignore[method-assign]
    h.m.enqueue_edu(D, "m.typing", {"room_id": "!a"}, key="!a")
    await wait_until(lambda: len(waiting), "the new queue waiting to bootstrap",
                     accept=lambda n: n == 1, timeout_s=10)
    assert not h.m.quiescent()

    settling = asyncio.create_task(h.settle())
    # settle() saw the queue busy and waits for it (taken for idle, it would have
    # returned after its quiet turns instead): only then is the read let go.
    await wait_until(lambda: h.settle_waits, "settle() waiting for the bootstrapping queue",
                     timeout_s=10)
    assert not settling.done() and not h.m.quiescent()
    gate.set()
    await settling
    assert [e["edu_type"] for e in h.fake.received_edus(D)] == ["m.typing"]


async def test_retry_last_ts_advances_on_every_failed_attempt_in_catchup(h: Harness) -> None:
    """Synapse writes ``retry_last_ts`` at every attempt, also once the interval is at
    its cap (the admin API's and dashboard's "last retry" read it)."""
    from dataclasses import replace

    h.settings = replace(h.settings, backoff_max_s=7200.0)  # past catch-up's hour
    h.without_short_retry()  # the persisted schedule is what this test follows
    await room_with(h, "!a:l", D)
    await h.start()
    h.fake.behave(D, status=503)
    await h.writer.message("!a:l", ALICE)
    h.poke()
    await h.settle()
    await fail_until_catchup(h)
    seen: list[int] = []
    for _ in range(4):  # at the cap: the interval no longer grows
        st = h.m.status(D)
        assert st is not None and st.catching_up and st.next_retry_ts_ms is not None
        await h.advance(st.next_retry_ts_ms / 1000 - h.clock.time_s())
        row = await h.dest_row(D)
        assert row.retry_interval == 7_200_000
        seen.append(row.retry_last_ts)
    assert seen == sorted(set(seen)), seen  # a new value at each attempt
    assert seen[-1] == int(h.clock.time_s() * 1000)
