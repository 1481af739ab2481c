"""Event fan-out and the transaction loop against real loopback HTTP."""

from __future__ import annotations

import json
from contextlib import AbstractContextManager

import pytest
from canonicaljson import encode_canonical_json
from sqlalchemy import select

from federation_sender.queue import fanout
from federation_sender.storage import schema as s
from federation_sender.storage.positions import EVENTS_STREAM
from federation_sender.testing.queue_harness import (
    ALICE,
    ME,
    Harness,
    RecordingObserver,
    room_with,
)
from federation_sender.testing.waiting import wait_until
from federation_sender.transport.result import SendResult, Transaction


async def test_fanout_sends_our_events_to_joined_servers_only(h: Harness) -> None:
    await room_with(h, "!a:l", "r1.test", "r2.test")
    await h.writer.join("!other:l", ALICE)
    await h.start()
    e1 = await h.writer.message("!a:l", ALICE)
    await h.writer.message("!a:l", "@bob:r1.test")  # not ours
    await h.writer.message("!a:l", ALICE, outlier=True)  # out-of-band
    await h.writer.message("!other:l", ALICE)  # nobody remote
    h.poke()
    await h.settle()
    assert h.fake.received_event_ids("r1.test") == [e1.event_id]
    assert h.fake.received_event_ids("r2.test") == [e1.event_id]
    assert set(h.fake.attempts) == {"r1.test", "r2.test"}
    txn = h.fake.accepted("r1.test")[0]
    assert txn.origin == ME
    async with h.engine.connect() as conn:
        rows = (await conn.execute(select(s.destination_rooms))).all()
        pos = (await conn.execute(select(s.stream_positions.c.stream_id).where(
            s.stream_positions.c.stream_name == EVENTS_STREAM))).scalar()
    assert sorted(tuple(r) for r in rows) == [
        ("r1.test", "!a:l", e1.stream_ordering), ("r2.test", "!a:l", e1.stream_ordering)]
    assert pos == h.writer.stream_ordering
    r1 = await h.dest_row("r1.test")
    assert r1.last_successful_stream_ordering == e1.stream_ordering
    log = await h.txlog("r1.test")
    assert [json.loads(r.pdu_event_ids) for r in log] == [[e1.event_id]]
    assert log[0].max_stream_ordering == e1.stream_ordering and log[0].catchup is False


async def test_transactions_carry_each_pdu_encoded_once_for_every_destination(
    h: Harness,
) -> None:
    """The fan-out encodes each event once; every destination's transaction carries
    those bytes (``Transaction.pdu_bytes``), so the federation client signs what it
    would have encoded itself, without encoding it again per destination."""
    seen: list[Transaction] = []
    send = h.sender.send_transaction

    async def recording(txn: Transaction) -> SendResult:
        seen.append(txn)
        return await send(txn)

    h.sender.send_transaction = recording  # type: ignore[method-assign]
    await room_with(h, "!a:l", "r1.test", "r2.test")
    await h.start()
    await h.writer.message("!a:l", ALICE, pad=40)
    await h.writer.message("!a:l", ALICE)
    h.poke()
    await h.settle()
    assert {t.destination for t in seen} == {"r1.test", "r2.test"}
    for t in seen:
        assert t.pdu_bytes is not None
        assert list(t.pdu_bytes) == [encode_canonical_json(p) for p in t.pdus]
    # One encoding per event, shared: the same bytes object in both destinations'.
    a, b = (next(t for t in seen if t.destination == d) for d in ("r1.test", "r2.test"))
    assert all(x is y for x, y in zip(a.pdu_bytes or (), b.pdu_bytes or (), strict=True))


async def test_kicked_server_gets_its_kick_then_nothing(h: Harness) -> None:
    await room_with(h, "!a:l", "r1.test", "r2.test")
    await h.start()
    kick = await h.writer.membership("!a:l", "@bob:r1.test", "leave", sender=ALICE)
    after = await h.writer.message("!a:l", ALICE)
    h.poke()
    await h.settle()
    assert h.fake.received_event_ids("r1.test") == [kick.event_id]
    assert h.fake.received_event_ids("r2.test") == [kick.event_id, after.event_id]


async def test_shard_filter_and_destination_rows_before_backoff(h: Harness) -> None:
    await room_with(h, "!a:l", "r1.test", "r2.test")
    h.shard = lambda d: d != "r2.test"
    await h.start()
    await h.writer.message("!a:l", ALICE)
    h.poke()
    await h.settle()
    assert set(h.fake.attempts) == {"r1.test"}
    # Only our shard is sent to, but every destination is recorded: whichever instance
    # owns r2.test (now or after a membership change) catches up from the row.
    async with h.engine.connect() as conn:
        dests = (await conn.execute(select(s.destination_rooms.c.destination))).scalars().all()
    assert sorted(dests) == ["r1.test", "r2.test"]


async def test_batches_at_most_50_pdus_in_order(h: Harness) -> None:
    await room_with(h, "!a:l", "r1.test")
    await h.start()
    h.fake.behave("r1.test", hang=True)  # hold the first transaction so the rest queue up
    first = await h.writer.message("!a:l", ALICE)
    h.poke()
    await wait_until(lambda: h.fake.in_progress, "a transaction in flight",
                     accept=lambda n: n == 1, timeout_s=10)
    evs = await h.writer.messages("!a:l", ALICE, 120)
    h.poke()
    await wait_until(lambda: h.m.fanout.position, "the fan-out caught up",
                     accept=lambda p: p == h.writer.stream_ordering, timeout_s=10)
    h.fake.behave("r1.test")
    h.fake.release()
    await h.settle()
    txns = h.fake.accepted("r1.test")
    assert [len(t.pdus) for t in txns] == [1, 50, 50, 20]
    assert h.fake.received_event_ids("r1.test") == [first.event_id] + [e.event_id for e in evs]


async def test_byte_budget_is_respected(h: Harness) -> None:
    from dataclasses import replace
    h.settings = replace(h.settings, max_txn_bytes=20_000)
    await room_with(h, "!a:l", "r1.test")
    await h.start()
    h.fake.behave("r1.test", hang=True)
    await h.writer.message("!a:l", ALICE)
    h.poke()
    await wait_until(lambda: h.fake.in_progress, "a transaction in flight",
                     accept=lambda n: n == 1, timeout_s=10)
    await h.writer.messages("!a:l", ALICE, 30, pad=2_000)
    h.poke()
    await wait_until(lambda: h.m.fanout.position, "the fan-out caught up",
                     accept=lambda p: p == h.writer.stream_ordering, timeout_s=10)
    h.fake.behave("r1.test")
    h.fake.release()
    await h.settle()
    sizes = [t.body_bytes for t in h.fake.accepted("r1.test")]
    assert max(sizes) <= 20_000 and sum(len(t.pdus) for t in h.fake.accepted("r1.test")) == 31


async def test_edu_order_in_one_transaction(h: Harness) -> None:
    await room_with(h, "!a:l", "r1.test")
    await h.start()
    d = "r1.test"
    h.fake.behave(d, hang=True)
    h.m.enqueue_edu(d, "m.warmup", {})
    await wait_until(lambda: h.fake.in_progress, "a transaction in flight",
                     accept=lambda n: n == 1, timeout_s=10)
    h.m.enqueue_edu(d, "m.typing", {"room_id": "!a:l", "typing": True}, key="!a:l")
    h.m.enqueue_edu(d, "m.custom", {})
    h.m.enqueue_edu(d, "m.typing", {"room_id": "!a:l", "typing": False}, key="!a:l")
    h.m.enqueue_receipt(d, "!a:l", "m.read", ALICE, {"event_ids": ["$x"]})
    h.m.enqueue_presence(d, [{"user_id": ALICE, "presence": "online"}])
    await h.writer.to_device(d, {"message_id": "m1", "messages": {}})
    await h.writer.device_list(d, ALICE, "DEV")
    h.m.notify_outbox(d)
    h.fake.behave(d)
    h.fake.release()
    await h.settle()
    txns = h.fake.accepted(d)
    assert txns[-1].edu_types == ["m.presence", "m.receipt", "m.direct_to_device",
                                  "m.device_list_update", "m.custom", "m.typing"]
    assert txns[-1].edus[-1]["content"]["typing"] is False
    async with h.engine.connect() as conn:
        sent_ts = (await conn.execute(select(s.device_federation_outbox.c.sent_ts))).scalar()
        sent = (await conn.execute(select(s.device_lists_outbound_pokes.c.sent))).scalar()
    assert sent_ts is not None and sent


async def test_global_concurrency_limit(h: Harness) -> None:
    """Three slots, eight queues with a transaction: three in flight. The three holding
    a slot have opened their attempt (span, request); the five waiting for one have not,
    so a spike's thousands of waiting queues hold neither. Each opens its own once it
    gets a slot."""
    from dataclasses import replace
    opened: list[str] = []

    class Counting(RecordingObserver):
        def attempt(self, destination: str, txn_id: str, pdu_count: int, edu_count: int,
                    catchup: bool) -> AbstractContextManager[None]:
            opened.append(destination)
            return super().attempt(destination, txn_id, pdu_count, edu_count, catchup)

    h.observer = Counting()
    h.settings = replace(h.settings, max_concurrent_transactions=3)
    remotes = [f"r{i}.test" for i in range(8)]
    await room_with(h, "!a:l", *remotes)
    await h.start()
    h.fake.behave(None, hang=True)
    await h.writer.message("!a:l", ALICE)
    h.poke()
    await wait_until(lambda: (h.fake.in_progress, h.m.runners.txn_slots.waiting),
                     "3 transactions in flight and 5 waiting for a slot",
                     accept=lambda seen: seen == (3, 5), timeout_s=10)
    assert len(opened) == 3
    assert h.m.oldest_in_flight_age_s() == 0.0
    h.fake.behave(None)
    h.fake.release()
    await h.settle()
    assert all(len(h.fake.accepted(r)) == 1 for r in remotes)
    assert sorted(opened) == sorted(remotes)


async def test_poll_mode_finds_events_without_a_poke(h: Harness) -> None:
    await room_with(h, "!a:l", "r1.test")
    await h.start(poll_interval_s=1.0)
    e = await h.writer.message("!a:l", ALICE)
    # Advanced a poll interval at a time: the fan-out's first sleep may begin after the
    # first advance (it flaked once so), never after two.
    waited = await h.advance_until(
        lambda: h.fake.received_event_ids("r1.test") == [e.event_id], step_s=1.0, max_s=10.0)
    assert waited <= 2.0


async def test_one_batch_across_rooms_and_membership_changes(h: Harness) -> None:
    """Recipient lists are shared between events with the same membership snapshot; a
    destination in several rooms (or several snapshots) still gets each of its events
    once, in stream order, and destination_rooms holds the last one per room."""
    await room_with(h, "!a:l", "r1.test", "r2.test")
    await room_with(h, "!b:l", "r1.test", "r3.test")
    await h.start()
    sent: list[tuple[str, str, int]] = []  # (room, event id, stream ordering) of ours
    for i in range(6):
        for room in ("!a:l", "!b:l"):
            e = await h.writer.message(room, ALICE)
            sent.append((room, e.event_id, e.stream_ordering))
        if i == 2:
            join = await h.writer.join("!a:l", "@carol:r3.test")  # not ours: not sent
            leave = await h.writer.membership("!b:l", "@bob:r1.test", "leave")  # not ours
    kick = await h.writer.membership("!b:l", "@bob:r3.test", "leave", sender=ALICE)
    sent.append(("!b:l", kick.event_id, kick.stream_ordering))
    h.poke()
    await h.settle()

    def ids(pick: list[tuple[str, str, int]]) -> list[str]:
        return [e for _, e, _ in pick]

    want = {
        # r1: all of !a:l; !b:l until its user left.
        "r1.test": [x for x in sent if x[0] == "!a:l" or x[2] < leave.stream_ordering],
        "r2.test": [x for x in sent if x[0] == "!a:l"],
        # r3: all of !b:l (its own kick included); !a:l once carol joined.
        "r3.test": [x for x in sent if x[0] == "!b:l" or x[2] > join.stream_ordering],
    }
    for d, evs in want.items():
        assert h.fake.received_event_ids(d) == ids(evs), d
    async with h.engine.connect() as conn:
        rows = (await conn.execute(select(s.destination_rooms))).all()
    last = {(d, r): so for d, evs in want.items() for r, _, so in evs}
    assert sorted(tuple(r) for r in rows) == sorted((d, r, so) for (d, r), so in last.items())


async def test_a_name_that_is_no_server_name_gets_no_queue_and_no_retries(
    h: Harness, caplog: pytest.LogCaptureFixture,
) -> None:
    """``x'--`` or a name with ``<`` in a room's membership can never be reached: it
    used to get a queue and a 600 s backoff for ever (issue #42.6). Now it is left out of
    the fan-out, logged once, and no queue is ever made for it."""
    fanout._log_refused.cache_clear()  # once per name and process: this test's own
    await room_with(h, "!a:l", "r1.test", "x'--", "evil<b>.test", "r2.test:0")
    await h.start()
    e1 = await h.writer.message("!a:l", ALICE)
    await h.writer.message("!a:l", ALICE)
    h.poke()
    await h.settle()
    assert set(h.fake.attempts) == {"r1.test"}
    assert h.fake.received_event_ids("r1.test")[0] == e1.event_id
    async with h.engine.connect() as conn:
        rows = (await conn.execute(select(s.destination_rooms.c.destination))).scalars()
        assert set(rows) == {"r1.test"}
    for name in ("x'--", "evil<b>.test", "r2.test:0"):
        assert h.manager.queues.get(name) is None
        assert not h.manager.wake(name)
        refused = [r for r in caplog.records if r.getMessage().startswith(
            f"never sending to {name}: not a server name")]
        assert len(refused) == 1
