"""Receipts from the replication ``receipts`` stream: who gets them, when, and how they
are packed (real queues, real loopback HTTP, the native schema for room hosts)."""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Hashable
from typing import Any

from federation_sender.edus import EventMeta
from federation_sender.edus.receipts import MAX_TIME_IN_QUEUE_S, ReceiptFanout
from federation_sender.queue.core.batching import Limits, take_batch
from federation_sender.queue.core.items import PendingItems
from federation_sender.replication.rows import ReceiptsRow
from federation_sender.storage.backend import NativeBackend
from federation_sender.testing.clock import FakeClock
from federation_sender.testing.intake import native_intake
from federation_sender.testing.queue_harness import ALICE, ME, Harness, room_with


def receipt_edus(h: Harness, d: str) -> list[dict[str, Any]]:
    return [e["content"] for e in h.fake.received_edus(d) if e["edu_type"] == "m.receipt"]


async def test_private_and_remote_receipts_never_leave(h: Harness) -> None:
    await room_with(h, "!a:l", "r1.test")
    await h.start()
    handler = native_intake(h.m, NativeBackend(h.engine), ME, h.clock)
    rows = [
        ReceiptsRow("!a:l", "m.read.private", ALICE, "$p", None, {"ts": 1}),
        ReceiptsRow("!a:l", "m.read", "@bob:r1.test", "$b", None, {"ts": 2}),
        ReceiptsRow("!a:l", "m.read", ALICE, "$x", "thread1", {"ts": 3}),
    ]
    await handler.on_rows("receipts", "master", 7, rows)
    await h.settle()
    sent = {"event_ids": ["$x"], "data": {"ts": 3, "thread_id": "thread1"}}
    assert receipt_edus(h, "r1.test") == [{"!a:l": {"m.read": {ALICE: sent}}}]


def test_receipts_merge_per_thread_and_at_most_five_edus_per_transaction() -> None:
    p = PendingItems()
    p.add_receipt("!a", "m.read", "@u:l", {"event_ids": ["$1"], "data": {}})
    p.add_receipt("!a", "m.read", "@u:l", {"event_ids": ["$2"], "data": {}})  # replaces $1
    p.add_receipt("!a", "m.read", "@v:l", {"event_ids": ["$3"], "data": {}})
    for i in range(7):  # one thread each: none may replace another
        p.add_receipt("!a", "m.read", "@u:l", {"event_ids": [f"$t{i}"], "data": {"thread_id": i}})
    assert len(p.receipts) == 8
    assert p.receipts[0] == {"!a": {"m.read": {
        "@u:l": {"event_ids": ["$2"], "data": {}}, "@v:l": {"event_ids": ["$3"], "data": {}}}}}
    p.add_presence({"user_id": f"@p{i}:l", "presence": "online"} for i in range(120))
    first = take_batch(p, Limits())
    assert [e.edu_type for e in first.edus] == ["m.presence"] + ["m.receipt"] * 5
    assert len(first.edus[0].content["push"]) == 50  # Synapse's bound per presence EDU
    second = take_batch(p, Limits())
    assert [e.edu_type for e in second.edus] == ["m.presence"] + ["m.receipt"] * 3
    assert take_batch(p, Limits()).edus[0].content["push"][-1]["user_id"] == "@p119:l"
    assert not p


class Rooms:
    def __init__(self, hosts: Collection[str], meta: EventMeta | None) -> None:
        self.hosts, self.meta = hosts, meta

    async def current_hosts(self, room_id: str) -> Collection[str]:
        raise AssertionError("receipts go to the receipt hosts")

    async def receipt_hosts(self, room_id: str) -> Collection[str]:
        return self.hosts

    async def event_meta(self, room_id: str, event_id: str) -> EventMeta | None:
        return self.meta


class Sink:
    """Records the queue engine's calls; ``wake`` answers whether anything was queued."""

    def __init__(self) -> None:
        self.queued: dict[str, bool] = {}
        self.woken: list[str] = []

    def enqueue_edu(self, destination: str, edu_type: str, content: Any,
                    key: Hashable | None = None) -> None:
        raise AssertionError("receipts go through enqueue_receipt")

    def enqueue_receipt(self, destination: str, room_id: str, receipt_type: str,
                        user_id: str, data: Any, *, wake: bool = True) -> bool:
        self.queued[destination] = wake
        return True

    def wake(self, destination: str) -> bool:
        self.woken.append(destination)
        return True


ROW = ReceiptsRow("!big", "m.read", ALICE, "$e", None, {"ts": 1})
BIG = [f"s{i}.test" for i in range(12)] + [ME]


async def test_pacing_in_big_rooms() -> None:
    clock = FakeClock()
    now_ms = int(clock.time_s() * 1000)
    small = Sink()
    await ReceiptFanout(ME, Rooms(BIG[:9], EventMeta("@x:s0.test", 0)), small, clock).on_rows([ROW])
    assert small.queued == dict.fromkeys(BIG[:9], True)  # < 10 hosts: all at once
    recent = Sink()
    meta = EventMeta("@x:s0.test", now_ms - 59_000)
    await ReceiptFanout(ME, Rooms(BIG, meta), recent, clock).on_rows([ROW])
    assert recent.queued == dict.fromkeys(BIG[:12], True)  # a recent event: all at once
    old = Sink()
    fan = ReceiptFanout(ME, Rooms(BIG, EventMeta("@x:s0.test", now_ms - 61_000)), old, clock)
    await fan.on_rows([ROW])
    assert old.queued == {"s0.test": True} | dict.fromkeys(BIG[1:12], False)
    # The paced ones are woken one by one, all within 30 s.
    task = asyncio.create_task(fan.wakeups.run())
    try:
        await clock.advance_and_settle(0)
        assert old.woken == ["s1.test"]
        for _ in range(int(MAX_TIME_IN_QUEUE_S)):  # the fake clock wakes one sleep per step
            await clock.advance_and_settle(1.0)
        assert old.woken == BIG[1:12]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_paced_receipt_waits_for_the_wakeup(h: Harness) -> None:
    remotes = [f"r{i}.test" for i in range(10)]
    await room_with(h, "!a:l", *remotes)
    old = await h.writer.message("!a:l", "@bob:r0.test")
    await h.start()
    h.poke()
    await h.settle()
    await h.clock.advance_and_settle(120)
    handler = native_intake(h.m, NativeBackend(h.engine), ME, h.clock)
    row = ReceiptsRow("!a:l", "m.read", ALICE, old.event_id, None, {"ts": 1})
    await handler.on_rows("receipts", "master", 1, [row])
    await h.settle()
    assert [d for d in remotes if receipt_edus(h, d)] == ["r0.test"]  # the sender's server
    task = asyncio.create_task(handler.fanouts.receipts.wakeups.run())
    try:
        for _ in range(int(MAX_TIME_IN_QUEUE_S)):  # the fake clock wakes one sleep per step
            await h.clock.advance_and_settle(1.0)
        await h.settle()
        assert all(receipt_edus(h, d) for d in remotes)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
