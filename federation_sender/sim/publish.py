"""How the simulator obtains stream ids and announces new rows: the :class:`Publisher`.

The main process's rule (``streams.md``) is: reserve stream ids, write the rows in a
transaction, then complete the ids; readers hear of completed rows as RDATA. A
rolled-back transaction still completes its ids, with no rows, or the stream position
would stall forever. :class:`~federation_sender.sim.store.SimStore` follows that rule
through this small protocol, so the same simulator runs

* against the real writer (:class:`WriterPublisher` over
  :class:`~federation_sender.replication.server.ReplicationWriter`, whose subscribers
  are the TCP server or the Redis publisher), or
* with no replication at all (:class:`RecordingPublisher`: ids only, rows kept for
  tests; the worker then polls the database).

Rows are the Synapse wire rows (JSON arrays), e.g. ``["ev", [event_id, ...]]`` for
``events``, ``[destination]`` for ``to_device``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Literal, Protocol

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from federation_sender.clock import Clock
from federation_sender.replication.redis import RedisWriterBridge
from federation_sender.replication.server import ReplicationWriter
from federation_sender.replication.tcp import TcpReplicationServer
from federation_sender.storage import schema

JsonRow = object
"""One stream row as JSON-serialisable data."""

EVENTS = "events"
TO_DEVICE = "to_device"
DEVICE_LISTS = "device_lists"
STREAMS = (EVENTS, TO_DEVICE, DEVICE_LISTS)


class Publisher(Protocol):
    async def reserve(self, stream: str, count: int) -> list[int]:
        """``count`` new ascending stream ids of ``stream``."""

    async def complete(self, stream: str, rows: Mapping[int, Sequence[JsonRow]]) -> None:
        """Complete every id in ``rows`` (an id mapped to ``[]`` was abandoned)."""


async def stream_positions(engine: AsyncEngine) -> dict[str, int]:
    """The highest id persisted in each stream's table: where a writer resumes."""
    async with engine.connect() as conn:
        events = await conn.scalar(select(func.max(schema.events.c.stream_ordering)))
        to_device = await conn.scalar(select(func.max(schema.device_federation_outbox.c.stream_id)))
        device_lists = await conn.scalar(
            select(func.max(schema.device_lists_outbound_pokes.c.stream_id))
        )
    return {
        EVENTS: int(events or 0),
        TO_DEVICE: int(to_device or 0),
        DEVICE_LISTS: int(device_lists or 0),
    }


class RecordingPublisher:
    """Ids from in-memory counters; completed rows kept in order, for tests and polling."""

    def __init__(self, positions: Mapping[str, int] | None = None) -> None:
        self._next = {s: (positions or {}).get(s, 0) + 1 for s in STREAMS}
        self.completed: dict[str, list[tuple[int, JsonRow]]] = {s: [] for s in STREAMS}
        self.abandoned: dict[str, list[int]] = {s: [] for s in STREAMS}

    async def reserve(self, stream: str, count: int) -> list[int]:
        start = self._next[stream]
        self._next[stream] = start + count
        return list(range(start, start + count))

    async def complete(self, stream: str, rows: Mapping[int, Sequence[JsonRow]]) -> None:
        for token in sorted(rows):
            if not rows[token]:
                self.abandoned[stream].append(token)
            self.completed[stream].extend((token, r) for r in rows[token])


class WriterPublisher:
    """Publishes through the real replication writer (RDATA/POSITION to its subscribers)."""

    def __init__(self, writer: ReplicationWriter) -> None:
        self.writer = writer

    @classmethod
    async def for_database(
        cls,
        engine: AsyncEngine,
        server_name: str,
        instance_name: str = "master",
        *,
        floor: Mapping[str, int] | None = None,
    ) -> WriterPublisher:
        """A writer whose streams resume from what the database already holds.

        ``floor``: ids already handed out by a previous writer (e.g. reserved for a
        transaction that then failed). A real homeserver draws stream ids from a
        database sequence and never reuses one; a restarted simulator must not either,
        or a reader that already moved past an abandoned id would never see the new
        row that reused it.
        """
        writer = ReplicationWriter(server_name, instance_name)
        for stream, current in (await stream_positions(engine)).items():
            writer.add_stream(stream, current=max(current, (floor or {}).get(stream, 0)))
        return cls(writer)

    def positions(self) -> dict[str, int]:
        """The highest id reserved so far in each stream (a ``floor`` for a successor)."""
        return {name: s.ids.last_reserved for name, s in self.writer.streams.items()}

    async def reserve(self, stream: str, count: int) -> list[int]:
        return [self.writer.reserve(stream) for _ in range(count)]

    async def complete(self, stream: str, rows: Mapping[int, Sequence[JsonRow]]) -> None:
        for token in sorted(rows):
            self.writer.complete(stream, token, rows[token])


@contextlib.asynccontextmanager
async def serve_replication(
    writer: ReplicationWriter,
    *,
    transport: Literal["tcp", "redis", "none"],
    clock: Clock,
    host: str = "127.0.0.1",
    port: int = 0,
    redis_url: str = "redis://127.0.0.1:6379/0",
    redis_ready_timeout_s: float = 10.0,
) -> AsyncIterator[int | None]:
    """Serve ``writer`` to readers for the duration of the block.

    ``tcp`` yields the listening port (``port=0``: any free one); ``redis`` publishes
    on channel ``<server_name>`` and yields ``None`` once subscribed (or raises
    ``TimeoutError`` after ``redis_ready_timeout_s``); ``none`` serves nothing.
    """
    if transport == "tcp":
        server = TcpReplicationServer(writer, clock=clock, host=host, port=port)
        await server.start()
        try:
            yield server.port
        finally:
            await server.close()
    elif transport == "redis":
        bridge = RedisWriterBridge(writer, redis_url, clock=clock)
        task = asyncio.create_task(bridge.run(), name="sim-redis-writer")
        try:
            async with asyncio.timeout(redis_ready_timeout_s):
                await bridge.ready.wait()
            yield None
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    else:
        yield None
