"""The replication client over recorded input (no sockets): what it persists, what it
logs. The wire bytes go through the real connection parser."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence

import pytest

from federation_sender.intake.positions import DbPositionStore
from federation_sender.intake.streams import ROW_PARSERS
from federation_sender.replication.client import ReplicationClient
from federation_sender.replication.positions import PositionStore
from federation_sender.replication.rows import ToDeviceStreamRow
from federation_sender.storage.backend import NativeBackend
from federation_sender.storage.engine import create_engine
from federation_sender.storage.migrate import upgrade
from federation_sender.testing.clock import FakeClock
from federation_sender.testing.replication import (
    InMemoryPositionStore,
    MemorySession,
    MemoryTransport,
    RecordingHandler,
)

A = ToDeviceStreamRow("a")


@contextlib.asynccontextmanager
async def replay(
    wire: Sequence[bytes], store: PositionStore | None = None
) -> AsyncIterator[tuple[ReplicationClient, RecordingHandler]]:
    """Run a client over one recorded session until it has ended and the client waits
    (on the fake clock) to reconnect."""
    clock = FakeClock()
    handler = RecordingHandler()
    client = ReplicationClient(
        MemoryTransport([MemorySession(wire, clock)]),
        instance_name="fed1",
        store=store or InMemoryPositionStore(),
        fetchers={},
        handler=handler,
        clock=clock,
        streams={"to_device": ROW_PARSERS["to_device"]},
    )
    task = asyncio.create_task(client.run())
    try:
        await handler.wait_for(lambda: client.sessions_opened == 1 and clock.pending_sleepers)
        yield client, handler
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_in_memory_persisted_position_equals_the_database(sqlite_url: str) -> None:
    """A writer reset moves the in-memory position back; the database never moves back,
    and the client's idea of what is persisted (what it rolls back to) is the database's."""
    engine = create_engine(sqlite_url)
    await upgrade(engine)
    try:
        store = DbPositionStore(NativeBackend(engine), "fed1")
        await store.save("to_device", "master", 10)
        wire = b'SERVER hs\nPOSITION to_device master 2 2\nRDATA to_device master 3 ["a"]\n'
        async with replay([wire], store) as (client, handler):
            assert handler.rows("to_device") == [A]
            in_db = await store.load()
            assert in_db == {("to_device", "master"): 10}
            assert client.positions.persisted() == in_db
            assert client.positions.get("to_device", "master") == 10  # rolled back to it
    finally:
        await engine.dispose()


async def test_rdata_for_an_unknown_stream_is_logged_once_per_stream(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="federation_sender.replication")
    wire = [
        b"SERVER hs\n",
        b'RDATA frobs master 1 ["x"]\nRDATA frobs master 2 ["y"]\n',
        b'RDATA push_rules master 3 ["@u:hs"]\nRDATA widgets master 4 ["z"]\n',
        b'RDATA frobs master 5 ["w"]\nRDATA to_device master 6 ["a"]\n',
    ]
    async with replay(wire) as (_client, handler):
        assert handler.rows("to_device") == [A]
    unknown = [m for m in caplog.messages if "unknown stream" in m]
    assert len(unknown) == 2, unknown
    assert "'frobs'" in unknown[0] and "'widgets'" in unknown[1]
