"""The group commit of transaction results (``QueuePersistence``): a destination's write that
failed is never overtaken by its later writes."""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import Awaitable, Callable, Collection
from dataclasses import replace
from typing import TypeVar

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from federation_sender.model import TxnLogRow
from federation_sender.queue.core.effects import Effects
from federation_sender.queue.persistence import QueuePersistence
from federation_sender.storage import destinations as dst
from federation_sender.storage.backend import NativeBackend
from federation_sender.storage.protocols import Backend, SendTimeFacts, Tx
from federation_sender.testing.queue_harness import ALICE, Harness, room_with

D = "remote.test"
OTHER = "other.test"
T = TypeVar("T")


class HeldWrites:
    """A backend whose transactions begin only once the test releases them: the first
    ``run`` sets ``started`` (the flusher has taken a batch and is writing it), so a test
    submits its next results while that write is in progress, not a loop turn after it
    may have begun."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.started = asyncio.Event()
        self._go = asyncio.Event()

    @property
    def name(self) -> str:
        return self.backend.name

    def release(self) -> None:
        self._go.set()

    async def run(self, fn: Callable[[Tx], Awaitable[T]]) -> T:
        self.started.set()
        await self._go.wait()
        return await self.backend.run(fn)

    async def send_time_facts(self, event_ids: Collection[str],
                              senders: Collection[str]) -> SendTimeFacts:
        return await self.backend.send_time_facts(event_ids, senders)


async def write_under_way(store: QueuePersistence, backend: HeldWrites) -> None:
    """Wait until the flusher has taken the first batch and its write has begun."""
    async with asyncio.timeout(10):
        await backend.started.wait()
    assert store.commits == 1 and not store.idle


def log_row(txn_id: str, destination: str, event_id: str, so: int,
            request_bytes: int = 100) -> TxnLogRow:
    return TxnLogRow(txn_id, destination, "fed1", 1, 0, request_bytes, "success", 200,
                     1_000, 5, False, so, (event_id,), None)


async def test_a_failed_write_is_not_overtaken_by_the_same_destinations_later_ones(
    engine: AsyncEngine,
) -> None:
    """T1 (event $a, position 10) got its 200, but its write fails (here: a value the
    column cannot hold; in the chaos run, PostgreSQL down for longer than the retry
    budget). T2 (event $b, position 20) was submitted while T1's write ran. If T2's write
    committed, the position would be past $a with no log of $a's delivery: the audit
    counts $a lost, and catch-up never looks at it again. T2's write must fail with T1's
    (the queue then restarts in catch-up from the persisted position and resends);
    another destination's write in the same window still commits."""
    backend = NativeBackend(engine)
    held = HeldWrites(backend)
    store = QueuePersistence(held)
    t1 = store.submit(D, Effects(last_successful=10, succeeded=True),
                      log_row("t1", D, "$a", 10, request_bytes=2**70), 0)
    assert t1 is not None
    await write_under_way(store, held)  # T1's batch, alone
    t2 = store.submit(D, Effects(last_successful=20, succeeded=True),
                      log_row("t2", D, "$b", 20), 0)
    other = store.submit(OTHER, Effects(last_successful=7, succeeded=True),
                         log_row("o1", OTHER, "$c", 7), 0)
    assert t2 is not None and other is not None
    held.release()
    results = await asyncio.gather(t1, t2, other, return_exceptions=True)
    assert isinstance(results[0], Exception)
    assert results[1] is results[0], "T2's write committed without T1's"
    assert results[2] is None
    await store.drain()

    async def read(tx):  # type: ignore[no-untyped-def]
        return (await tx.destinations.get_destination(D),
                await tx.destinations.get_destination(OTHER),
                await tx.txlog.recent_transactions(D), await tx.txlog.recent_transactions(OTHER))

    row, other_row, log_d, log_other = await backend.run(read)
    assert row is None or row.last_successful_stream_ordering is None
    assert log_d == []
    assert other_row is not None and other_row.last_successful_stream_ordering == 7
    assert [r.txn_id for r in log_other] == ["o1"]


async def test_failed_writes_nobody_awaits_are_not_printed_at_exit(
    engine: AsyncEngine, caplog: pytest.LogCaptureFixture,
) -> None:
    """The runner awaits its oldest unpersisted write and fails on it; its later writes
    fail with it and are dropped unawaited. asyncio must not print each of those with a
    traceback when they are collected ("Future exception was never retrieved")."""
    held = HeldWrites(NativeBackend(engine))
    store = QueuePersistence(held)
    t1 = store.submit(D, Effects(last_successful=10, succeeded=True),
                      log_row("t1", D, "$a", 10, request_bytes=2**70), 0)
    await write_under_way(store, held)
    t2 = store.submit(D, Effects(last_successful=20, succeeded=True),
                      log_row("t2", D, "$b", 20), 0)
    assert t1 is not None and t2 is not None
    held.release()
    with pytest.raises(Exception):  # noqa: B017 - whatever the driver raises
        await t1
    await store.drain()
    assert t2.done()
    del t1, t2
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        gc.collect()
    assert "never retrieved" not in caplog.text


_REFUSE_LOG = {
    "sqlite": [
        "CREATE TRIGGER refuse_log BEFORE INSERT ON federation_transaction_log"
        " BEGIN SELECT RAISE(ABORT, 'transaction log refused'); END",
    ],
    "postgresql": [
        "CREATE FUNCTION refuse_log() RETURNS trigger LANGUAGE plpgsql AS"
        " $$ BEGIN RAISE EXCEPTION 'transaction log refused'; END $$",
        "CREATE TRIGGER refuse_log BEFORE INSERT ON federation_transaction_log"
        " FOR EACH ROW EXECUTE FUNCTION refuse_log()",
    ],
}


@pytest.mark.parametrize("gather_s", [None, 0.0], ids=["default-window", "no-window"])
async def test_catchup_episode_position_waits_for_its_transactions_writes(
        hdb: Harness, gather_s: float | None) -> None:
    """A catch-up transaction got its 200 but its write failed (the database refuses the
    log row). The episode then finds no more rows: its end position must not be recorded
    without that write, past a PDU whose delivery is in no log. The queue fails and, recreated
    from the database, catches up again from the old position once writes work. Without
    the group commit's gathering window (``queue.commit_gather_s: 0``) the transaction's
    write may fail only after the episode has ended: the end waits for it."""
    h, w = hdb, hdb.writer
    # One room per read: after the transaction, the queue reads again (finding nothing)
    # and ends the episode while the transaction's write is being committed.
    h.settings = replace(h.settings, catchup_rooms_per_batch=1)
    if gather_s is not None:
        h.settings = replace(h.settings, commit_gather_s=gather_s)
    await room_with(h, "!a:l", D)
    base = w.stream_ordering
    ev = await w.message("!a:l", ALICE)
    async with h.engine.begin() as conn:
        await dst.upsert_destination_rooms(conn, [(D, "!a:l", ev.stream_ordering)])
        await dst.set_last_successful_stream_ordering(conn, D, base)
        for sql in _REFUSE_LOG[h.engine.dialect.name]:
            await conn.execute(text(sql))
    await h.start()
    await h.m.wake_due_destinations()
    await h.settle()
    assert h.fake.received_event_ids(D) == [ev.event_id]  # delivered, but not recorded
    row = await h.dest_row(D)
    assert row.last_successful_stream_ordering == base, "position moved without the log"
    async with h.engine.begin() as conn:
        await conn.execute(text("DROP TRIGGER refuse_log" + (
            " ON federation_transaction_log" if h.engine.dialect.name == "postgresql" else "")))
    await h.m.wake_due_destinations()
    await h.settle()
    assert h.fake.received_event_ids(D) == [ev.event_id, ev.event_id]  # resent
    assert [r.pdu_event_ids for r in await h.txlog(D)] == [f'["{ev.event_id}"]']
    assert (await h.dest_row(D)).last_successful_stream_ordering == ev.stream_ordering


async def test_results_submitted_within_the_gathering_window_share_one_commit(
    engine: AsyncEngine,
) -> None:
    """``queue.commit_gather_s``: results arriving one loop turn apart, as a spread of
    round trips brings them, wait for the window and commit together; without the
    window the first goes alone (the flusher starts at once)."""
    backend = NativeBackend(engine)

    async def commits_for(gather_s: float) -> tuple[int, int]:
        store = QueuePersistence(backend, commit_gather_s=gather_s)
        futs = []
        for i in range(20):
            f = store.submit(f"d{i}.test", Effects(last_successful=i + 1, succeeded=True),
                             None, 0)
            assert f is not None
            futs.append(f)
            await asyncio.sleep(0)  # one loop turn between results
        await asyncio.gather(*futs)
        await store.drain()
        return store.commits, store.committed_results

    alone, carried = await commits_for(0.0)
    assert carried == 20 and alone >= 2  # the first result went before the others came
    assert await commits_for(0.2) == (1, 20)

    async def positions(tx):  # type: ignore[no-untyped-def]
        return await tx.destinations.get_destinations([f"d{i}.test" for i in range(20)])

    rows = await backend.run(positions)
    assert sorted(r.last_successful_stream_ordering for r in rows.values()) == list(range(1, 21))
