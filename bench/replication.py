"""Replication benchmarks; prints figures for docs/benchmarks.md.

1. RDATA lines parsed and dispatched per second: recorded writer bytes (real
   Synapse ``events`` rows from the captures, renumbered) go through the real
   connection (framing, UTF-8, parse, direction checks), the client's dispatch
   (typed row parsing, positions), a no-op handler and position persistence.
2. Rows per second end to end: a ReplicationWriter publishes events rows to a
   TcpReplicationServer; a ReplicationClient reads them over loopback TCP.
   Writer and reader share one process and one event loop, so the figure is
   for both sides on one core.

Wall-clock rates depend on what else the machine runs; rates per CPU-second of
this process (``time.process_time``) show the code's own cost.

Usage: python bench/replication.py [--lines N] [--rows N]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections.abc import Sequence

from federation_sender.clock import SystemClock
from federation_sender.intake.streams import ROW_PARSERS
from federation_sender.replication.client import ReplicationClient
from federation_sender.replication.rows import EventsStreamRow, Row
from federation_sender.replication.server import ReplicationWriter
from federation_sender.replication.tcp import TcpReplicationServer, TcpTransport
from federation_sender.testing.captures import captures_dir
from federation_sender.testing.replication import (
    InMemoryPositionStore,
    MemorySession,
    MemoryTransport,
)

CAPTURE = captures_dir() / "spike_slice.redis.txt"


class CountingHandler:
    def __init__(self, target_token: int) -> None:
        self.rows = 0
        self.target = target_token
        self.done = asyncio.Event()

    async def on_rows(self, stream: str, instance: str, token: int, rows: Sequence[Row]) -> None:
        self.rows += len(rows)
        if token >= self.target:
            self.done.set()

    async def on_remote_server_up(self, server: str) -> None:
        pass


def recorded_rows() -> list[str]:
    rows = []
    for raw in CAPTURE.read_text().splitlines():
        if raw.startswith("#"):
            continue
        line = raw.split("\t", 2)[2]
        if line.startswith("RDATA events "):
            rows.append(line.split(" ", 4)[4])
    return rows


async def bench_parse_dispatch(n_lines: int) -> tuple[float, float]:
    rows = recorded_rows()
    lines = [f"RDATA events master {i} {rows[i % len(rows)]}\n" for i in range(1, n_lines + 1)]
    data = ("SERVER hs\nPOSITION events master 0 0\n" + "".join(lines)).encode()
    chunks = [data[i : i + 65536] for i in range(0, len(data), 65536)]
    clock = SystemClock()
    handler = CountingHandler(n_lines)
    client = ReplicationClient(
        MemoryTransport([MemorySession(chunks, clock)]),
        instance_name="fed1",
        store=InMemoryPositionStore(),
        fetchers={},
        handler=handler,
        clock=clock,
        streams=ROW_PARSERS,
    )
    start, cpu = time.perf_counter(), time.process_time()
    task = asyncio.create_task(client.run())
    await handler.done.wait()
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    task.cancel()
    assert handler.rows == n_lines
    return n_lines / elapsed, n_lines / cpu


async def bench_end_to_end(n_rows: int) -> tuple[float, float]:
    clock = SystemClock()
    writer = ReplicationWriter("hs")
    writer.add_stream("events")
    server = TcpReplicationServer(writer, clock=clock)
    await server.start()
    handler = CountingHandler(n_rows)
    client = ReplicationClient(
        TcpTransport("127.0.0.1", server.port, clock=clock, client_name="fed1"),
        instance_name="fed1",
        store=InMemoryPositionStore(),
        fetchers={},
        handler=handler,
        clock=clock,
        streams=ROW_PARSERS,
        rng=random.Random(0),
    )
    task = asyncio.create_task(client.run())
    await client.connected.wait()
    while client.positions.get("events", "master") is None:  # noqa: ASYNC110 - a poll
        await asyncio.sleep(0.01)
    template = [f"$event{i}:hs" for i in range(1000)]
    start, cpu = time.perf_counter(), time.process_time()
    published = 0
    while published < n_rows:
        for _ in range(min(500, n_rows - published)):
            published += 1
            event_id = template[published % 1000]
            writer.publish(
                "events",
                EventsStreamRow(
                    event_id, "!room:hs", "m.room.message", None, None, None, None, False, False
                ),
            )
        await asyncio.sleep(0)  # let the server flush and the reader read
    await handler.done.wait()
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    task.cancel()
    await server.close()
    assert handler.rows == n_rows
    return n_rows / elapsed, n_rows / cpu


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lines", type=int, default=300_000)
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    parse = [await bench_parse_dispatch(args.lines) for _ in range(args.repeat)]
    e2e = [await bench_end_to_end(args.rows) for _ in range(args.repeat)]
    for label, runs in (("RDATA parsed+dispatched", parse), ("rows end to end (TCP)", e2e)):
        wall = sorted(r[0] for r in runs)
        cpu = sorted(r[1] for r in runs)
        print(
            f"{label:24} wall: best {wall[-1]:,.0f}/s median {wall[len(wall) // 2]:,.0f}/s;"
            f" per CPU-second: median {cpu[len(cpu) // 2]:,.0f}/s"
        )


if __name__ == "__main__":
    asyncio.run(main())
