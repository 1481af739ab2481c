"""When the replication client writes its positions (``save_interval_s``): once per
interval under load instead of once per received line, and never so late that a
restart loses anything. Recorded input through the real connection parser, time on a
fake clock."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import pytest

from federation_sender.intake.streams import ROW_PARSERS
from federation_sender.replication import commands as c
from federation_sender.replication.client import ReplicationClient
from federation_sender.replication.rows import ToDeviceStreamRow
from federation_sender.testing.clock import FakeClock
from federation_sender.testing.replication import (
    InMemoryPositionStore,
    MemorySession,
    MemoryTransport,
    RecordingHandler,
    WriterDatabase,
)

KEY = ("to_device", "master")


def rdata(token: int) -> bytes:
    return f'RDATA to_device master {token} ["@u{token}:hs"]\n'.encode()


def live_session(clock: FakeClock) -> MemorySession:
    """A session at position 0 that stays open for :meth:`MemorySession.feed`."""
    return MemorySession([b"SERVER hs\nPOSITION to_device master 0 0\n"], clock,
                         hold_open=True)


class FlakyStore(InMemoryPositionStore):
    """A store whose next ``fail_next`` saves raise, as a database that went away."""

    def __init__(self) -> None:
        super().__init__()
        self.fail_next = 0

    async def save(self, stream: str, instance: str, token: int) -> None:
        if self.fail_next:
            self.fail_next -= 1
            raise OSError("database unreachable")
        await super().save(stream, instance, token)


@contextlib.asynccontextmanager
async def running(
    sessions: list[MemorySession],
    store: InMemoryPositionStore,
    clock: FakeClock,
    interval_s: float,
    db: WriterDatabase | None = None,
) -> AsyncIterator[tuple[ReplicationClient, RecordingHandler, asyncio.Task[None]]]:
    handler = RecordingHandler()
    client = ReplicationClient(
        MemoryTransport(sessions),
        instance_name="fed1",
        store=store,
        fetchers={"to_device": db.fetcher("to_device")} if db is not None else {},
        handler=handler,
        clock=clock,
        streams={"to_device": ROW_PARSERS["to_device"]},
        save_interval_s=interval_s,
    )
    task = asyncio.create_task(client.run())
    try:
        yield client, handler, task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_positions_are_saved_once_per_interval_not_once_per_line() -> None:
    clock = FakeClock()
    store = InMemoryPositionStore()
    session = live_session(clock)
    async with running([session], store, clock, 1.0) as (_client, handler, _task):
        for token in range(1, 6):
            session.feed(rdata(token))
        await handler.wait_for(lambda: handler.last_token("to_device") == 5)
        await clock.advance_and_settle(0.0)
        assert store.saves == 0 and KEY not in store.positions

        await clock.advance_and_settle(0.5)
        assert store.saves == 0  # the interval counts from the first unsaved update
        await clock.advance_and_settle(0.5)
        assert store.positions[KEY] == 5
        assert store.saves == 1  # five lines, one write

        # Quiet: nothing unsaved, nothing written, however long it stays quiet.
        await clock.advance_and_settle(10.0)
        assert store.saves == 1

        session.feed(rdata(6))
        await handler.wait_for(lambda: handler.last_token("to_device") == 6)
        await clock.advance_and_settle(0.0)  # the client ends the batch: its save is due in 1 s
        await clock.advance_and_settle(1.0)
        assert (store.positions[KEY], store.saves) == (6, 2)


async def test_interval_zero_saves_after_every_received_batch() -> None:
    clock = FakeClock()
    store = InMemoryPositionStore()
    session = live_session(clock)
    async with running([session], store, clock, 0.0) as (_client, handler, _task):
        for token in range(1, 4):
            session.feed(rdata(token))
            await handler.wait_for(lambda t=token: store.positions.get(KEY) == t)
        assert store.saves == 4  # the POSITION's, then one per line


@pytest.mark.parametrize("how", ["session ends", "client stopped"])
async def test_finished_work_is_saved_when_the_session_ends_or_the_client_stops(
    how: str,
) -> None:
    clock = FakeClock()
    store = InMemoryPositionStore()
    session = live_session(clock)
    async with running([session], store, clock, 3600.0) as (client, handler, task):
        session.feed(rdata(1) + rdata(2))
        await handler.wait_for(lambda: handler.last_token("to_device") == 2)
        assert KEY not in store.positions
        if how == "session ends":
            session.end()
            await handler.wait_for(lambda: store.positions.get(KEY) == 2)
            # Saved before the in-memory positions roll back to the saved ones.
            assert client.positions.persisted() == {KEY: 2}
        else:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            assert store.positions[KEY] == 2


async def test_a_failed_save_keeps_the_positions_and_retries_at_the_next_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="federation_sender.replication")
    clock = FakeClock()
    store = FlakyStore()
    store.fail_next = 1
    session = live_session(clock)
    async with running([session], store, clock, 1.0) as (client, handler, _task):
        session.feed(rdata(1))
        await handler.wait_for(lambda: handler.last_token("to_device") == 1)
        await clock.advance_and_settle(0.0)  # the client ends the batch: its save is due in 1 s
        await clock.advance_and_settle(1.0)
        assert KEY not in store.positions
        assert client.positions.persisted() == {}
        assert "saving positions failed (database unreachable); retried" in caplog.text
        await clock.advance_and_settle(1.0)
        assert store.positions[KEY] == 1
        assert client.positions.persisted() == {KEY: 1}


async def test_a_crash_before_the_save_delivers_the_unsaved_rows_again() -> None:
    """The process dies (no clean stop) after handling tokens 1-4 with only 2 saved:
    the next worker starts from 2 and the writer's POSITION makes it fetch 3-4 again.
    Nothing is lost; the replay is the at-least-once the handlers already allow."""
    clock = FakeClock()
    db = WriterDatabase()
    wire = b"".join(rdata(t) for t in range(1, 5))
    db.record(
        [c.RdataCommand("to_device", "master", t, [f"@u{t}:hs"]) for t in range(1, 5)]
    )
    store = InMemoryPositionStore()
    first = live_session(clock)
    async with running([first], store, clock, 1.0) as (_client, handler, _task):
        first.feed(rdata(1) + rdata(2))
        await handler.wait_for(lambda: handler.last_token("to_device") == 2)
        await clock.advance_and_settle(0.0)  # the client ends the batch: its save is due in 1 s
        await clock.advance_and_settle(1.0)
        assert store.positions[KEY] == 2
        first.feed(wire[len(rdata(1) + rdata(2)):])
        await handler.wait_for(lambda: handler.last_token("to_device") == 4)
        on_disk = dict(store.positions)  # what a crash now leaves behind
    assert on_disk == {KEY: 2}

    second = MemorySession([b"SERVER hs\nPOSITION to_device master 4 4\n"], clock)
    async with running([second], InMemoryPositionStore(on_disk), clock, 1.0, db) as (
        _client,
        handler,
        _task,
    ):
        await handler.wait_for(lambda: handler.last_token("to_device") == 4)
        assert handler.rows("to_device") == [
            ToDeviceStreamRow("@u3:hs"), ToDeviceStreamRow("@u4:hs")
        ]
