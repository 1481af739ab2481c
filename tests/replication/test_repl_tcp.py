"""Client and server over real loopback TCP: delivery, reconnects mid-batch, writer
restarts, bad input, keepalive on a fake clock, congestion. Network waits are bounded."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from federation_sender.clock import SystemClock
from federation_sender.intake.streams import ROW_PARSERS
from federation_sender.replication.client import ReplicationClient
from federation_sender.replication.connection import Limits
from federation_sender.replication.reconnect import Backoff
from federation_sender.replication.row_checks import EXTRA_FIELDS_WARNED
from federation_sender.replication.rows import EventsStreamRow, ToDeviceStreamRow, TypingRow
from federation_sender.replication.server import ReplicationWriter
from federation_sender.replication.tcp import TcpReplicationServer, TcpTransport
from federation_sender.testing.clock import FakeClock
from federation_sender.testing.loopback import loopback_server
from federation_sender.testing.replication import (
    InMemoryPositionStore,
    RecordingHandler,
    WriterDatabase,
)
from federation_sender.testing.waiting import wait_until

FAST = Backoff(initial_s=0.01, max_s=0.05)
WAIT_S = 10.0


def event(i: int) -> EventsStreamRow:
    return EventsStreamRow(
        f"$e{i}", "!r:hs", "m.room.message", None, None, None, None, False, False
    )


@dataclass
class Reader:
    client: ReplicationClient
    handler: RecordingHandler
    store: InMemoryPositionStore
    task: asyncio.Task[None]


@contextlib.asynccontextmanager
async def reader(
    port: int,
    db: WriterDatabase | None = None,
    *,
    clock: SystemClock | FakeClock | None = None,
    store: InMemoryPositionStore | None = None,
    name: str = "fed1",
) -> AsyncIterator[Reader]:
    clock = clock or SystemClock()
    store = store or InMemoryPositionStore()
    handler = RecordingHandler()
    fetchers = {} if db is None else {s: db.fetcher(s) for s in ("events", "to_device")}
    client = ReplicationClient(
        TcpTransport("127.0.0.1", port, clock=clock, client_name=name, expected_server_name="hs"),
        instance_name=name,
        store=store,
        fetchers=fetchers,
        handler=handler,
        clock=clock,
        streams=ROW_PARSERS,
        rng=random.Random(1),
        backoff=FAST,
    )
    task = asyncio.create_task(client.run())
    try:
        yield Reader(client, handler, store, task)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@contextlib.asynccontextmanager
async def serving(
    writer: ReplicationWriter, port: int = 0, **kw: object
) -> AsyncIterator[TcpReplicationServer]:
    server = TcpReplicationServer(writer, clock=SystemClock(), port=port, **kw)  # type: ignore[arg-type]
    await server.start()
    try:
        yield server
    finally:
        await server.close()


def new_writer(*, events_at: int = 0, events_history: str = "ev-h1") -> ReplicationWriter:
    w = ReplicationWriter("hs")
    w.add_stream("events", current=events_at, history_id=events_history)
    w.add_stream("typing")  # in memory: a new history on every start
    w.add_stream("to_device")
    w.add_stream("push_rules")  # not consumed: skipped by the reader
    return w


async def test_rows_flow_and_positions_persist() -> None:
    w = new_writer()
    async with serving(w) as server, reader(server.port) as r:
        await asyncio.wait_for(r.client.connected.wait(), WAIT_S)
        await r.handler.wait_for(lambda: r.client.positions.get("events", "master") == 0)
        for i in range(1, 51):
            w.publish("events", event(i))
        w.publish("to_device", ToDeviceStreamRow("a.example"), ToDeviceStreamRow("b.example"))
        w.publish("push_rules", ["@u:hs"])
        w.publish("typing", TypingRow("!r:hs", ("@u:hs",)))
        await r.handler.wait_for(lambda: len(r.handler.rows("typing")) == 1)
        assert r.handler.rows("events") == [event(i) for i in range(1, 51)]
        assert r.handler.rows("to_device") == [
            ToDeviceStreamRow("a.example"), ToDeviceStreamRow("b.example")
        ]
        assert r.store.positions[("events", "master")] == 50
        assert ("push_rules", "master") not in r.store.positions


async def test_federation_ack_and_remote_server_up() -> None:
    w = new_writer()
    async with serving(w) as server, reader(server.port) as a, reader(server.port, name="b") as b:
        for x in (a, b):
            # The writer's POSITION answers REPLICATE: it has taken both readers in.
            await x.handler.wait_for(lambda x=x: x.client.positions.get("events", "master") == 0)
        a.client.send_federation_ack(7)
        a.client.send_remote_server_up("remote.example")
        await b.handler.wait_for(lambda: b.handler.servers_up == ["remote.example"])
        assert w.federation_acks == {"fed1": 7}
        assert a.handler.servers_up == []  # not echoed to its origin


async def test_reconnect_mid_stream_loses_nothing() -> None:
    w = new_writer()
    db = WriterDatabase(w)
    async with serving(w) as server, reader(server.port, db) as r:
        await r.handler.wait_for(lambda: r.client.positions.get("events", "master") == 0)
        for round_ in range(5):
            for i in range(round_ * 200 + 1, round_ * 200 + 201):
                w.publish("events", event(i))
                if i % 77 == 0:
                    for peer in list(server.peers):
                        peer.writer.transport.abort()  # cut mid-stream
        await r.handler.wait_for(lambda: r.client.positions.get("events", "master") == 1000)
        rows = r.handler.rows("events")
        assert sorted(set(rows), key=lambda e: int(e.event_id[2:])) == [
            event(i) for i in range(1, 1001)
        ]
        assert r.client.sessions_opened > 1
        assert r.store.positions[("events", "master")] == 1000


@contextlib.asynccontextmanager
async def _raw_server(
    script: list[list[bytes]],
) -> AsyncIterator[tuple[int, asyncio.Queue[tuple[int, bytes]]]]:
    """Connection n gets script[n] and then stays open; what it receives is queued.
    Yields the port and that queue."""
    received: asyncio.Queue[tuple[int, bytes]] = asyncio.Queue()
    count = 0

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        nonlocal count
        n, count = count, count + 1
        for chunk in script[min(n, len(script) - 1)]:
            w.write(chunk)
        with contextlib.suppress(ConnectionError):
            while line := await r.readline():
                await received.put((n, line))

    async with loopback_server(handle) as port:
        yield port, received


async def _until(received: asyncio.Queue[tuple[int, bytes]], pred: object) -> tuple[int, bytes]:
    assert callable(pred)
    while True:
        item = await asyncio.wait_for(received.get(), WAIT_S)
        if pred(item):
            return item


async def test_partial_batch_then_reconnect_fetches_from_the_database() -> None:
    db = WriterDatabase()
    rows = [ToDeviceStreamRow("a"), ToDeviceStreamRow("b"), ToDeviceStreamRow("c")]
    db.rows[("to_device", "master")] = [(1, rows[0]), (1, rows[1]), (1, rows[2])]
    first = [
        b"SERVER hs\nPOSITION to_device master 0 0\n",
        b'RDATA to_device master batch ["a"]\nRDATA to_device master batch ["b"]\n',
        b"ERROR server stopping\n",
    ]
    second = [b"SERVER hs\nPOSITION to_device master 1 1\n"]
    script = [first, second]
    state = {"n": 0}
    received: asyncio.Queue[tuple[int, bytes]] = asyncio.Queue()

    async def handle(rd: asyncio.StreamReader, wr: asyncio.StreamWriter) -> None:
        n = state["n"]
        state["n"] += 1
        for chunk in script[min(n, 1)]:
            wr.write(chunk)
        await wr.drain()
        if n == 0:
            # Read the client's opening (NAME, PING, REPLICATE) first: closed with it
            # unread, the connection would be reset, which may discard the batch before
            # the client reads it. Closed after, the client reads the batch, then EOF.
            line = b"-"
            async with asyncio.timeout(WAIT_S):
                while line and not line.startswith(b"REPLICATE"):
                    line = await rd.readline()
            wr.close()  # drop the connection mid-batch
            return
        with contextlib.suppress(ConnectionError):
            while line := await rd.readline():
                await received.put((n, line))

    async with loopback_server(handle) as port, reader(port, db) as r:
        await r.handler.wait_for(lambda: r.handler.rows("to_device") == rows)
        assert r.store.positions[("to_device", "master")] == 1
        assert r.client.sessions_opened == 2


BAD_INPUTS = [
    (b"RDATA to_device master 6 [123]\n", b"invalid to_device row"),
    (b"FROBNICATE 1\n", b"unknown command"),
    (b"REPLICATE\n", b"not allowed"),
    (b"PING " + b"x" * 17000 + b"\n", b"too long"),
    (b"RDATA to_device master 6 [\xff]\n", b"UTF-8"),
    (b"POSITION to_device master 9 3\n", b"prev token 9 is above new token 3"),
]


@pytest.mark.parametrize(("bad", "reason"), BAD_INPUTS)
async def test_bad_input_gets_error_keeps_position_and_reconnects(
    bad: bytes, reason: bytes
) -> None:
    script = [[b"SERVER hs\nPOSITION to_device master 5 5\n", bad]]
    store = InMemoryPositionStore({("to_device", "master"): 5})
    async with _raw_server(script) as (port, received), reader(port, store=store) as r:
        n, line = await _until(received, lambda item: item[1].startswith(b"ERROR"))
        assert reason in line
        await _until(received, lambda item: item[0] > n)  # reconnected
        assert store.positions == {("to_device", "master"): 5}
        assert not r.task.done()


async def test_server_name_mismatch_is_refused() -> None:
    async with _raw_server([[b"SERVER impostor\n"]]) as (port, received), reader(port):
        _, line = await _until(received, lambda item: item[1].startswith(b"ERROR"))
        assert b"impostor" in line


async def test_keepalive_and_timeout_on_a_fake_clock(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="federation_sender.replication")
    clock = FakeClock()
    async with _raw_server(
        [[b"SERVER hs\nPING 1\nPOSITION to_device master 1 1\n"]]
    ) as (port, received), reader(port, clock=clock) as r:
        await _until(received, lambda item: item[1].startswith(b"REPLICATE"))
        await asyncio.wait_for(r.client.connected.wait(), WAIT_S)
        # Commands are handled in order: once the POSITION is, so is the PING before it.
        await r.handler.wait_for(lambda: r.client.positions.get("to_device", "master") == 1)
        await clock.advance_and_settle(5)
        _, line = await _until(received, lambda item: item[1].startswith(b"PING"))
        for _ in range(4):
            await clock.advance_and_settle(5)
        assert received.empty() or not (await received.get())[1].startswith(b"ERROR")
        await clock.advance_and_settle(5)  # 25 s since the server's PING
        _, line = await _until(received, lambda item: item[1].startswith(b"ERROR"))
        assert line == b"ERROR ping timeout\n"

        def ended() -> list[str]:
            return [m for m in caplog.messages if "disconnected from" in m]

        await r.handler.wait_for(ended)
        assert ended()[0].endswith(": closed by us: ping timeout"), ended()


async def test_congested_reader_is_disconnected() -> None:
    w = new_writer()
    async with serving(w, limits=Limits(max_outbound=50)) as server:
        rd, wr = await asyncio.open_connection("127.0.0.1", server.port)
        wr.write(b"NAME stuck\nREPLICATE\n")
        await wr.drain()
        await asyncio.wait_for(rd.readuntil(b"POSITION"), WAIT_S)  # REPLICATE handled
        big = "x" * 8000
        for _ in range(3000):  # ~24 MB, far beyond the socket buffers
            w.publish("to_device", ToDeviceStreamRow(big))
            await asyncio.sleep(0)
        data = await asyncio.wait_for(rd.read(), WAIT_S)
        assert data.rstrip(b"\n").rsplit(b"\n", 1)[-1] == b"ERROR Failed to keep up"
        assert len(data) < 12_000_000  # most of the 24 MB was dropped, not delivered
        wr.close()
        await wait_until(lambda: server.peers, "the server to forget the closed peer",
                         accept=lambda peers: not peers, timeout_s=1)


async def test_writer_restart_resets_in_memory_streams_without_dropping_rows() -> None:
    w1 = new_writer()
    db = WriterDatabase(w1)
    async with serving(w1) as server:
        port = server.port
        async with reader(port, db) as r:
            await r.handler.wait_for(lambda: r.client.positions.get("typing", "master") == 0)
            for i in range(1, 21):
                w1.publish("events", event(i))
                w1.publish("typing", TypingRow("!r:hs", (f"@u{i}:hs",)))
            await r.handler.wait_for(lambda: r.client.positions.get("typing", "master") == 20)
            await server.close()
            # The main process restarts: events continue in the same history (from
            # the database); typing is in memory and starts again at 0.
            w2 = new_writer(events_at=20)
            db2 = WriterDatabase(w2)
            db.rows.update(db2.rows)
            db2.rows = db.rows
            async with serving(w2, port=port):
                await r.handler.wait_for(
                    lambda: (
                        r.client.positions.history("typing", "master")
                        == w2.streams["typing"].history_id
                    )
                )
                w2.publish("typing", TypingRow("!r:hs", ("@new:hs",)))
                w2.publish("events", event(21))
                await r.handler.wait_for(lambda: len(r.handler.rows("events")) == 21)
                await r.handler.wait_for(
                    lambda: TypingRow("!r:hs", ("@new:hs",)) in r.handler.rows("typing")
                )
                assert r.client.positions.get("typing", "master") == 1
                assert r.client.positions.get("events", "master") == 21


async def test_connects_and_disconnects_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    w = new_writer()
    caplog.set_level("INFO", logger="federation_sender.replication.client")
    async with serving(w) as server, reader(server.port) as r:
        where = f"tcp://127.0.0.1:{server.port}"
        await asyncio.wait_for(r.client.connected.wait(), WAIT_S)
        for peer in list(server.peers):
            peer.writer.transport.abort()
        await r.handler.wait_for(lambda: r.client.sessions_opened == 2)
        await asyncio.wait_for(r.client.connected.wait(), WAIT_S)
    lines = [(rec.levelname, rec.getMessage()) for rec in caplog.records]
    connected = ("INFO", f"replication: connected to {where} as fed1")
    assert lines.count(connected) == 2
    first = lines.index(connected)
    assert any(level == "WARNING" and msg.startswith(f"replication: disconnected from {where}")
               for level, msg in lines[first:])


async def test_longer_rows_from_a_newer_writer_are_read_not_refused(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A newer Synapse's ``ev`` row with a tenth field: read by its nine known fields,
    one warning, no ERROR and no reconnect. (Before, each such row ended the session
    and the writer sent it again on the next: 12 reconnects in 13 s, position stuck.)"""
    caplog.set_level(logging.WARNING, logger="federation_sender.replication")
    EXTRA_FIELDS_WARNED.clear()
    ev = '["$e{0}","!r:hs","m.room.message",null,null,null,null,false,false,{{"new":1}}]'
    lines = [f'RDATA events master {i} ["ev",{ev.format(i)}]\n'.encode() for i in (6, 7)]
    script = [[b"SERVER hs\nPOSITION events master 5 5\n", *lines]]
    store = InMemoryPositionStore({("events", "master"): 5})
    async with _raw_server(script) as (port, received), reader(port, store=store) as r:
        await r.handler.wait_for(lambda: store.positions.get(("events", "master")) == 7)
        assert r.handler.rows("events") == [event(6), event(7)]
        assert r.client.sessions_opened == 1
        got = []
        while not received.empty():
            got.append((await received.get())[1])
        assert not [g for g in got if g.startswith(b"ERROR")], got
    warnings = [m for m in caplog.messages if "extra ones are ignored" in m]
    assert warnings == [
        "replication: events 'ev' rows have 10 fields, 9 known here: the extra ones are "
        "ignored (a newer Synapse?); logged once"
    ]
