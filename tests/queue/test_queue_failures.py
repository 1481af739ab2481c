"""Retries, backoff, splitting, isolation, deadlines and status over real HTTP."""

from __future__ import annotations

import logging

import pytest

from federation_sender.queue.core.isolation import SERVER_ERROR_FACTOR
from federation_sender.queue.core.states import DestinationState
from federation_sender.storage import destinations as dst
from federation_sender.testing.queue_harness import ALICE, Harness, room_with
from federation_sender.testing.waiting import wait_until
from federation_sender.transport.result import Outcome

D = "r1.test"


async def start_with_room(h: Harness) -> None:
    await room_with(h, "!a:l", D)
    await h.start()


async def test_txn_id_is_stable_across_retries_and_backoff_schedule(h: Harness) -> None:
    h.without_short_retry()  # the persisted schedule from the first failure
    await start_with_room(h)
    h.fake.behave(D, status=503)
    e = await h.writer.message("!a:l", ALICE)
    h.poke()
    await h.settle()
    st = h.m.status(D)
    assert st is not None and st.state is DestinationState.BACKING_OFF
    assert st.retry_interval_ms == 600_000 and st.last_error == "HTTP 503 M_UNKNOWN: fake 503"
    row = await h.dest_row(D)
    assert row.retry_interval == 600_000 and row.failure_ts == row.retry_last_ts
    # New events while backing off are queued, not sent.
    await h.writer.message("!a:l", ALICE)
    h.poke()
    await h.advance(599)
    assert len(h.fake.attempts[D]) == 1
    # Retried by timer when the backoff ends; same txn id, same content.
    await h.advance(1)
    assert len(h.fake.attempts[D]) == 2
    a, b = h.fake.attempts[D]
    assert a.txn_id == b.txn_id and a.event_ids == b.event_ids == [e.event_id]
    interval = (await h.dest_row(D)).retry_interval
    assert 600_000 * 2 * 0.8 <= interval <= 600_000 * 2 * 1.4
    h.fake.behave(D)
    await h.advance(interval / 1000)
    accepted = h.fake.accepted(D)
    assert accepted[0].txn_id == a.txn_id and len(accepted) == 2
    assert accepted[1].txn_id != a.txn_id
    row = await h.dest_row(D)
    assert row.retry_interval == 0 and row.failure_ts is None
    assert h.m.status(D).state is DestinationState.IDLE  # type: ignore[union-attr]
    outcomes = [o for d, o, *_ in h.observer.sent if d == D]
    assert outcomes == [Outcome.TRANSIENT, Outcome.TRANSIENT, Outcome.SUCCESS, Outcome.SUCCESS]
    assert [r.status for r in await h.txlog(D)] == ["transient", "transient", "success",
                                                    "success"]


async def test_413_splits_instead_of_retrying_forever(h: Harness) -> None:
    await start_with_room(h)
    h.fake.behave(D, hang=True)
    await h.writer.message("!a:l", ALICE)
    h.poke()
    await wait_until(lambda: h.fake.in_progress, "a transaction in flight",
                     accept=lambda n: n == 1, timeout_s=10)
    evs = await h.writer.messages("!a:l", ALICE, 40, pad=1_000)
    h.poke()
    await wait_until(lambda: h.m.fanout.position, "the fan-out caught up",
                     accept=lambda p: p == h.writer.stream_ordering, timeout_s=10)
    h.fake.behave(D, max_body_bytes=12_000)
    h.fake.release()
    await h.settle()
    got = h.fake.received_event_ids(D)
    assert got[1:] == [e.event_id for e in evs]
    assert all(t.body_bytes <= 12_000 for t in h.fake.accepted(D))
    assert any(t.status == 413 for t in h.fake.attempts[D])
    assert not h.observer.dropped


async def test_single_item_too_large_is_dropped(h: Harness) -> None:
    await start_with_room(h)
    h.fake.behave(D, max_body_bytes=5_000)
    big = await h.writer.message("!a:l", ALICE, pad=10_000)
    small = await h.writer.message("!a:l", ALICE)
    h.poke()
    await h.settle()
    assert h.fake.received_event_ids(D) == [small.event_id]
    assert h.observer.dropped == [(D, "pdu", "too_large")]
    assert big.event_id not in h.fake.received_event_ids(D)
    row = await h.dest_row(D)
    assert row.last_successful_stream_ordering == small.stream_ordering


async def test_poison_item_is_isolated_and_dropped_while_the_rest_is_delivered(
    h: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "federation_sender.queue")
    await start_with_room(h)
    h.fake.behave(D, hang=True)
    await h.writer.message("!a:l", ALICE)
    h.poke()
    await wait_until(lambda: h.fake.in_progress, "a transaction in flight",
                     accept=lambda n: n == 1, timeout_s=10)
    evs = await h.writer.messages("!a:l", ALICE, 30)
    poison = evs[11]
    h.m.enqueue_edu(D, "m.bad", {})
    h.m.enqueue_edu(D, "m.good", {})
    h.poke()
    await wait_until(lambda: h.m.fanout.position, "the fan-out caught up",
                     accept=lambda p: p == h.writer.stream_ordering, timeout_s=10)
    h.fake.behave(D, reject_event_ids={poison.event_id}, reject_edu_types={"m.bad"},
                  reject_status=500)
    h.fake.release()
    # Isolation retries are spaced (1 s, 2 s, 4 s ... 30 s): the clock must move.
    await h.advance_until(lambda: len(h.observer.dropped) == 2, step_s=5, max_s=600)
    got = h.fake.received_event_ids(D)
    assert poison.event_id not in got
    assert sorted(got[1:]) == sorted(e.event_id for e in evs if e is not poison)
    assert [e["edu_type"] for e in h.fake.received_edus(D)] == ["m.good"]
    assert sorted(h.observer.dropped) == [(D, "m.bad", "refused"), (D, "pdu", "refused")]
    poison_attempts = [t for t in h.fake.attempts[D] if t.event_ids == [poison.event_id]]
    # A 500 may be a flaky server: the item is refused alone max_item_failures times
    # SERVER_ERROR_FACTOR over before it is blamed (a 400 blames it after 3).
    assert len(poison_attempts) == 3 * SERVER_ERROR_FACTOR
    st = h.m.status(D)
    assert st is not None and st.retry_interval_ms == 0  # the destination never backed off
    row = await h.dest_row(D)
    assert row.last_successful_stream_ordering == evs[-1].stream_ordering
    # The drop line names the item, its stream id and the destination.
    drops = [r.getMessage() for r in caplog.records if "dropping" in r.getMessage()]
    assert any(
        f"event {poison.event_id} (stream {poison.stream_ordering}) for {D}: refused" in m
        for m in drops
    ), drops


async def test_destination_refusing_everything_backs_off(h: Harness) -> None:
    await start_with_room(h)
    h.fake.behave(D, status=500)
    await h.writer.messages("!a:l", ALICE, 4)
    h.poke()
    await h.advance_until(
        lambda: h.m.status(D).state is DestinationState.BACKING_OFF,  # type: ignore[union-attr]
        step_s=5, max_s=600)
    assert len(h.fake.attempts[D]) <= 20
    assert not h.observer.dropped  # nothing got through: nothing is blamed on an item


async def test_hanging_request_hits_the_deadline(h: Harness) -> None:
    await start_with_room(h)
    h.fake.behave(D, hang=True)
    e = await h.writer.message("!a:l", ALICE)
    h.poke()
    await wait_until(lambda: h.fake.in_progress, "a transaction in flight",
                     accept=lambda n: n == 1, timeout_s=10)
    await h.clock.advance_and_settle(10)
    st = h.m.status(D)
    assert st is not None and st.in_flight_txn_id is not None
    assert st.in_flight_age_s == 10 and h.m.oldest_in_flight_age_s() == 10
    assert st.state is DestinationState.SENDING and st.pending_pdus == 1
    await h.advance(21)  # past the 30 s attempt deadline
    st = h.m.status(D)
    assert st is not None and st.state is DestinationState.BACKING_OFF
    assert st.in_flight_txn_id is None and h.m.oldest_in_flight_age_s() is None
    assert st.last_error is not None and "no answer within 30s" in st.last_error
    assert st.next_retry_ts_ms is not None
    h.fake.behave(D)
    h.fake.release()
    await h.advance(600)
    assert h.fake.received_event_ids(D) == [e.event_id]


async def test_remote_server_up_cuts_the_backoff_short(h: Harness) -> None:
    await start_with_room(h)
    h.fake.behave(D, status=503)
    e = await h.writer.message("!a:l", ALICE)
    h.poke()
    await h.settle()
    assert h.m.status(D).state is DestinationState.BACKING_OFF  # type: ignore[union-attr]
    h.fake.behave(D)
    await h.m.remote_server_up(D)
    await h.settle()
    assert h.fake.received_event_ids(D) == [e.event_id]
    assert (await h.dest_row(D)).retry_interval == 0
    assert not await h.m.reset_connection(D)  # not backing off any more


async def test_reset_connection(h: Harness) -> None:
    await start_with_room(h)
    h.fake.behave(D, status=503)
    await h.writer.message("!a:l", ALICE)
    h.poke()
    await h.settle()
    h.fake.behave(D)
    assert await h.m.reset_connection(D)
    await h.settle()
    assert len(h.fake.accepted(D)) == 1


async def test_429_is_a_brief_pause_not_the_failure_schedule(h: Harness) -> None:
    await start_with_room(h)
    h.fake.behave(D, status=429, times=1)
    e = await h.writer.message("!a:l", ALICE)
    h.poke()
    await h.settle()
    st = h.m.status(D)
    assert st is not None and st.state is DestinationState.BACKING_OFF
    assert st.retry_interval_ms == 0 and st.next_retry_ts_ms is not None
    row = await h.dest_row(D)
    assert not row.retry_interval  # nothing persisted
    waited = await h.advance_until(lambda: bool(h.fake.accepted(D)), step_s=1, max_s=60)
    assert waited <= 3  # seconds, not the ten-minute schedule
    first, second = h.fake.attempts[D]
    assert first.txn_id == second.txn_id and second.event_ids == [e.event_id]


async def test_a_success_resets_a_backoff_another_instance_wrote(h: Harness) -> None:
    await start_with_room(h)
    await h.writer.message("!a:l", ALICE)
    h.poke()
    await h.settle()
    # Another instance sharing the database failed to reach D and wrote a backoff.
    now_ms = int(h.clock.time_s() * 1000)
    async with h.engine.begin() as conn:
        await dst.set_retry_timings(conn, D, now_ms, now_ms, 600_000)
    assert (await h.dest_row(D)).retry_interval == 600_000
    await h.writer.message("!a:l", ALICE)
    h.poke()
    await h.settle()
    assert len(h.fake.accepted(D)) == 2
    row = await h.dest_row(D)
    assert row.retry_interval == 0 and row.failure_ts is None


async def test_the_last_error_is_kept_through_catch_up_until_a_success(h: Harness) -> None:
    """A destination past the catch-up threshold: its queue drops its items, walks an
    empty catch-up step and parks; the error stays visible until an answer clears it."""
    from dataclasses import replace

    h.settings = replace(h.settings, catchup_threshold_s=300.0, idle_queue_ttl_s=1.0)
    h.without_short_retry()
    await start_with_room(h)
    h.fake.behave(D, status=503)
    await h.writer.message("!a:l", ALICE)
    h.poke()
    await h.settle()
    await h.advance(2)  # past the idle TTL: the queue exits and is parked
    st = h.m.status(D)
    assert st is not None and st.catching_up and st.state is DestinationState.BACKING_OFF
    assert D not in {s.destination for s in h.m.statuses() if s.in_flight_txn_id}
    assert st.last_error == "HTTP 503 M_UNKNOWN: fake 503"
    h.fake.behave(D)
    await h.advance(st.retry_interval_ms / 1000)
    await wait_until(lambda: h.fake.accepted(D), "delivery after the backoff", timeout_s=10)
    await h.settle()
    st = h.m.status(D)
    assert st is None or st.last_error is None


async def test_a_dropped_idle_queue_tells_the_sender_to_forget_it(h: Harness) -> None:
    """A sender with ``forget_destination`` (the federation client) hears of every
    queue dropped after its idle TTL, so what it cached for that destination goes."""
    from dataclasses import replace

    forgotten: list[str] = []
    h.sender.forget_destination = forgotten.append  # type: ignore[attr-defined]
    h.settings = replace(h.settings, idle_queue_ttl_s=1.0)
    await start_with_room(h)
    await h.writer.message("!a:l", ALICE)
    h.poke()
    await h.settle()
    assert h.fake.accepted(D) and forgotten == []
    await h.advance(2)
    await wait_until(lambda: forgotten, "the idle queue dropped",
                     accept=lambda f: f == [D], timeout_s=10)


async def test_the_deadline_counts_from_each_attempt_s_start(h: Harness) -> None:
    """One timer per queue serves consecutive attempts: an attempt that starts after an
    earlier one armed it still gets its full 30 s, and no more."""
    await start_with_room(h)
    await h.writer.message("!a:l", ALICE)
    h.poke()
    await h.settle()  # a first, quick attempt armed the queue's timer at t=0
    await h.advance(20)
    h.fake.behave(D, hang=True)
    await h.writer.message("!a:l", ALICE)
    h.poke()
    await wait_until(lambda: h.fake.in_progress, "a transaction in flight",
                     accept=lambda n: n == 1, timeout_s=10)
    # t=35: past the first attempt's deadline, not this one's (in flight: no settle)
    await h.clock.advance_and_settle(15)
    st = h.m.status(D)
    assert st is not None and st.in_flight_age_s == 15 and st.state is DestinationState.SENDING
    await h.advance(16)  # t=51: 31 s into this attempt
    st = h.m.status(D)
    assert st is not None and st.state is DestinationState.BACKING_OFF
    assert st.last_error is not None and "no answer within 30s" in st.last_error
    h.fake.release()


async def test_a_crashed_queue_is_logged_with_its_destination(
        h: Harness, caplog: pytest.LogCaptureFixture) -> None:
    from federation_sender.telemetry.logging import ContextFilter
    from federation_sender.transport.result import SendResult, Transaction

    class Crashing:
        async def send_transaction(self, txn: Transaction) -> SendResult:
            raise RuntimeError("a bug in the sender")

    h.sender = Crashing()  # type: ignore[assignment]
    caplog.handler.addFilter(ContextFilter())
    caplog.set_level(logging.ERROR, logger="federation_sender.queue")
    await start_with_room(h)
    await h.writer.message("!a:l", ALICE)
    h.poke()
    await wait_until(lambda: any("failed" in r.getMessage() for r in caplog.records),
                     "the crash line", timeout_s=10)
    (record,) = [r for r in caplog.records if "queue for" in r.getMessage()][:1]
    assert record.context["destination"] == D  # type: ignore[attr-defined]


async def test_the_last_success_time_is_the_clock_of_the_last_answered_transaction(
    h: Harness,
) -> None:
    """The status (and so the admin API and dashboard) gives the last success as a time,
    not only a stream position; a failure after it leaves it as it was."""
    from federation_sender.clock import time_ms

    await start_with_room(h)
    st = h.m.status(D)
    assert st is None or st.last_success_ts_ms is None
    await h.writer.message("!a:l", ALICE)
    h.poke()
    await h.settle()
    delivered_at = time_ms(h.clock)
    st = h.m.status(D)
    assert st is not None and st.last_success_ts_ms == delivered_at
    await h.advance(30)
    h.fake.behave(D, status=503)
    await h.writer.message("!a:l", ALICE)
    h.poke()
    await h.settle()
    st = h.m.status(D)
    assert st is not None and st.state is DestinationState.BACKING_OFF
    assert st.last_success_ts_ms == delivered_at


async def test_instances_started_in_the_same_millisecond_use_distinct_txn_ids(
    h: Harness,
) -> None:
    """Two instances of one server started at the same instant (the clock does not
    move here) must not number transactions alike: after a hand-over the new owner's
    id could equal one the destination already answered, and be deduplicated unread."""
    import random

    from federation_sender.queue.manager import QueueManager
    from federation_sender.storage.backend import NativeBackend

    first = h.make_manager()
    second = QueueManager(NativeBackend(h.engine), h.sender, h.settings, "local.test",
                          "fs2", h.clock, random.Random(1), lambda _d: True)
    ids = [m.runners.next_txn_id() for m in (first, second)]
    assert ids[0] != ids[1] and all(i.endswith(".1") for i in ids), ids


async def test_a_queue_stopped_by_the_database_going_away_is_one_line(
        h: Harness, caplog: pytest.LogCaptureFixture) -> None:
    """A PostgreSQL restart (seen in the chaos run beside Synapse) is expected: the queue
    stops with one warning, no traceback, and is recreated from the database."""
    from sqlalchemy.exc import OperationalError

    from federation_sender.transport.result import SendResult, Transaction

    class DatabaseGone:
        async def send_transaction(self, txn: Transaction) -> SendResult:
            raise OperationalError("SELECT 1", {}, Exception("connection refused"))

    h.sender = DatabaseGone()  # type: ignore[assignment]
    caplog.set_level(logging.WARNING, logger="federation_sender.queue")
    await start_with_room(h)
    await h.writer.message("!a:l", ALICE)
    h.poke()
    await wait_until(lambda: any("queue for" in r.getMessage() for r in caplog.records),
                     "the queue's line", timeout_s=10)
    record = next(r for r in caplog.records if "queue for" in r.getMessage())
    assert record.levelno == logging.WARNING and record.exc_info is None
    assert record.getMessage() == (
        f"queue for {D} stopped, the database is unavailable ((builtins.Exception) "
        "connection refused); it will be recreated from the database"
    )


async def test_a_loop_stopped_by_the_database_going_away_is_one_line(
        h: Harness, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fan-out restarts 1 s after a failure (under the supervisor, kept running); a
    database restart (the second long chaos run beside Synapse) is one warning, no
    traceback."""
    import asyncio

    from sqlalchemy.exc import OperationalError

    calls = 0
    second = asyncio.Event()

    async def intake() -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise OperationalError("SELECT 1", {}, Exception("connection refused"))
        second.set()

    caplog.set_level(logging.WARNING, logger="federation_sender.queue")
    m = h.make_manager()
    monkeypatch.setattr(m.fanout, "run", intake)
    h.manager = m
    await m.start()
    await wait_until(lambda: calls == 1, "the first failure", timeout_s=10)
    assert not second.is_set()
    await h.clock.advance_and_settle(1.0)
    await asyncio.wait_for(second.wait(), 5)
    assert calls == 2
    (record,) = [r for r in caplog.records if "fan-out loop" in r.getMessage()]
    assert record.levelno == logging.WARNING and record.exc_info is None
    assert record.name == "federation_sender.queue.manager"
    assert record.getMessage() == (
        "queue fan-out loop stopped, the database is unavailable ((builtins.Exception) "
        "connection refused); restarting"
    )
