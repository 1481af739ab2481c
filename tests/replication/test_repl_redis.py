"""The Redis transport against a real redis-server on a free loopback port."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import shutil
from collections.abc import AsyncIterator, Iterator

import pytest
import redis.asyncio as aioredis

from federation_sender.clock import SystemClock
from federation_sender.intake.streams import ROW_PARSERS
from federation_sender.replication.client import ReplicationClient
from federation_sender.replication.connection import MAX_BUS_MESSAGE_BYTES
from federation_sender.replication.reconnect import Backoff
from federation_sender.replication.redis import RedisTransport, RedisWriterBridge
from federation_sender.replication.rows import EventsStreamRow, TypingRow
from federation_sender.replication.server import ReplicationWriter
from federation_sender.testing.captures import capture_lines
from federation_sender.testing.prereq import missing
from federation_sender.testing.redis_server import ephemeral_redis
from federation_sender.testing.replication import (
    InMemoryPositionStore,
    RecordingHandler,
    WriterDatabase,
)
from federation_sender.testing.waiting import wait_until

SERVER = "localhost:28448"



@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    binary = shutil.which("redis-server")
    if binary is None:
        missing("redis-server (Debian package redis-server)")
    with ephemeral_redis() as server:  # the module's own: its channels start empty
        yield server.url


def event(i: int) -> EventsStreamRow:
    return EventsStreamRow(
        f"$e{i}", "!r:hs", "m.room.message", None, None, None, None, False, False
    )


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
        streams=ROW_PARSERS,
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
        await wait_until(lambda: w.federation_acks, "the FEDERATION_ACK at the writer",
                         timeout_s=2)
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


def rdata_event(token: int) -> str:
    return (f'RDATA events master {token} ["ev",["$e{token}","!r:hs","m.room.message",'
            'null,null,null,null,false,false]]')


BAD_MESSAGES = {
    "longer than the bus limit": b"RDATA typing master 3 " + b"[" * MAX_BUS_MESSAGE_BYTES,
    "invalid UTF-8": b"RDATA typing master 3 [\"!r:hs\",[\"@\xff\xfe:hs\"]]",
    "POSITION with prev above new": b"POSITION events master 900 150",
    "row that fails to parse": b"RDATA typing master 3 [1,2,3]",
    "malformed command": b"POSITION events master x y",
    "RDATA without a row": b"RDATA events master 7",
    "not JSON": b"RDATA events master 7 [\"ev\",",
}


async def test_a_bad_message_on_the_bus_is_skipped_and_the_next_one_handled(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Each bad message is followed at once by a good RDATA: the good one is handled,
    the subscription stays, each bad one costs one warning. (Before, each dropped the
    subscription: what came in the next 0.3-1 s was lost.)"""
    caplog.set_level("WARNING", logger="federation_sender.replication")
    client, handler, store = make_reader(redis_url)
    publisher = aioredis.Redis.from_url(redis_url)
    async with run(client.run):
        await asyncio.wait_for(client.connected.wait(), 5)
        await publisher.publish(SERVER, "POSITION events master 100 100")
        await publisher.publish(SERVER, "POSITION typing master 2 2")
        await handler.wait_for(lambda: store.positions.get(("typing", "master")) == 2)
        good = []
        for i, bad in enumerate(BAD_MESSAGES.values()):
            good.append(101 + i)
            await publisher.publish(SERVER, bad)
            await publisher.publish(SERVER, rdata_event(101 + i))
        await publisher.publish(SERVER, "REMOTE_SERVER_UP done.example")
        await handler.wait_for(lambda: handler.servers_up == ["done.example"])
        assert [e.event_id for e in handler.rows("events")] == [f"$e{t}" for t in good]
        assert client.sessions_opened == 1
        assert store.positions[("typing", "master")] == 2
        assert client.positions.get("events", "master") == good[-1]
    await publisher.aclose()
    warnings = [r.getMessage() for r in caplog.records if "failed to parse" in r.getMessage()]
    assert len(warnings) == len(BAD_MESSAGES), warnings
    assert all(len(w) < 400 for w in warnings), "a long message is not logged whole"


async def test_lines_past_the_tcp_limit_are_handled_on_the_bus(redis_url: str) -> None:
    """Synapse limits lines to 16 KiB on TCP only; on Redis a typing row of many users
    or a presence row with a long status message is longer. Up to 1 MiB is handled."""
    client, handler, store = make_reader(redis_url)
    publisher = aioredis.Redis.from_url(redis_url)
    users = [f"@user{i:06d}:hs" for i in range(20_000)]  # 280 KB
    line = f'RDATA typing master 3 ["!r:hs",{json.dumps(users)}]'
    assert len(line) > 16 * 16_384
    async with run(client.run):
        await asyncio.wait_for(client.connected.wait(), 5)
        await publisher.publish(SERVER, "POSITION typing master 2 2")
        await handler.wait_for(lambda: store.positions.get(("typing", "master")) == 2)
        await publisher.publish(SERVER, line)
        await handler.wait_for(lambda: len(handler.rows("typing")) == 1)
        assert handler.rows("typing") == [TypingRow("!r:hs", tuple(users))]
        assert client.sessions_opened == 1
    await publisher.aclose()
