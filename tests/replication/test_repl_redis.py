"""The Redis transport against a real redis-server on a free loopback port."""

from __future__ import annotations

import asyncio
import contextlib
import random
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Iterator

import pytest
import redis.asyncio as aioredis

from federation_sender.clock import SystemClock
from federation_sender.replication.client import ReplicationClient
from federation_sender.replication.reconnect import Backoff
from federation_sender.replication.redis import RedisTransport, RedisWriterBridge
from federation_sender.replication.rows import EventRow, TypingRow
from federation_sender.replication.server import ReplicationWriter
from federation_sender.testing.captures import capture_lines
from federation_sender.testing.ports import free_port
from federation_sender.testing.prereq import missing
from federation_sender.testing.replication import (
    InMemoryPositionStore,
    RecordingHandler,
    WriterDatabase,
)

SERVER = "localhost:28448"



@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    binary = shutil.which("redis-server")
    if binary is None:
        missing("redis-server (Debian package redis-server)")
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", tmp],
            stdout=subprocess.DEVNULL,
        )
        try:
            for _ in range(200):
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port)):
                    break
                if proc.poll() is not None:
                    pytest.fail("redis-server exited")
                time.sleep(0.02)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            proc.terminate()
            proc.wait(timeout=10)


def event(i: int) -> EventRow:
    return EventRow(f"$e{i}", "!r:hs", "m.room.message", None, None, None, None, False, False)


@contextlib.asynccontextmanager
async def run(coro_fn: object) -> AsyncIterator[asyncio.Task[None]]:
    assert callable(coro_fn)
    task = asyncio.create_task(coro_fn())
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def make_reader(
    url: str, db: WriterDatabase | None = None
) -> tuple[ReplicationClient, RecordingHandler, InMemoryPositionStore]:
    clock = SystemClock()
    handler = RecordingHandler()
    store = InMemoryPositionStore()
    client = ReplicationClient(
        RedisTransport(url, SERVER, clock=clock),
        instance_name="fed1",
        store=store,
        fetchers={} if db is None else {"events": db.fetcher("events")},
        handler=handler,
        clock=clock,
        rng=random.Random(2),
        backoff=Backoff(0.01, 0.05),
    )
    return client, handler, store


async def test_writer_to_reader_over_redis(redis_url: str) -> None:
    w = ReplicationWriter(SERVER)
    w.add_stream("events")
    w.add_stream("typing")
    db = WriterDatabase(w)
    bridge = RedisWriterBridge(w, redis_url, clock=SystemClock())
    client, handler, store = make_reader(redis_url, db)
    async with run(bridge.run), run(client.run):
        await asyncio.wait_for(bridge.ready.wait(), 5)
        await handler.wait_for(lambda: client.positions.get("events", "master") == 0)
        assert client.positions.history("events", "master") == w.streams["events"].history_id
        for i in range(1, 101):
            w.publish("events", event(i))
        w.publish("typing", TypingRow("!r:hs", ("@a:hs",)), TypingRow("!r2:hs", ()))
        await handler.wait_for(lambda: len(handler.rows("typing")) == 2)
        assert handler.rows("events") == [event(i) for i in range(1, 101)]
        client.send_federation_ack(100)
        client.send_remote_server_up("remote.example")
        for _ in range(200):
            if w.federation_acks:
                break
            await asyncio.sleep(0.01)
        assert w.federation_acks == {"fed1": 100}
        assert store.positions[("events", "master")] == 100
        # our own REMOTE_SERVER_UP came back from Redis and was ignored as an echo
        assert handler.servers_up == []


async def test_real_synapse_capture_replayed_on_the_channel(redis_url: str) -> None:
    client, handler, _store = make_reader(redis_url)
    publisher = aioredis.Redis.from_url(redis_url)
    async with run(client.run):
        await asyncio.wait_for(client.connected.wait(), 5)
        lines = capture_lines()
        for line in lines:
            await publisher.publish(SERVER, line)
        await publisher.publish(SERVER, "REMOTE_SERVER_UP done.example")
        await handler.wait_for(lambda: handler.servers_up == ["done.example"])
        # The captures are replayed in name order: the 10 events of the EDU
        # capture are new; the spike's tokens (152..) are below the POSITION 5661
        # of the restart capture, so they are duplicates and dropped.
        assert len(handler.rows("events")) == 10
        assert len(handler.rows("typing")) == 20
        assert len(handler.rows("to_device")) == 30
        assert client.sessions_opened == 1  # LOCK_RELEASED etc. skipped, not errors
    await publisher.aclose()


async def test_bad_line_on_the_bus_resubscribes_without_moving_positions(redis_url: str) -> None:
    client, handler, store = make_reader(redis_url)
    publisher = aioredis.Redis.from_url(redis_url)
    async with run(client.run):
        await asyncio.wait_for(client.connected.wait(), 5)
        await publisher.publish(SERVER, "POSITION typing master 3 3")
        await handler.wait_for(lambda: store.positions.get(("typing", "master")) == 3)
        await publisher.publish(SERVER, "RDATA typing master 4 [1,2,3]")
        await handler.wait_for(lambda: client.sessions_opened == 2)
        assert store.positions[("typing", "master")] == 3
    await publisher.aclose()
