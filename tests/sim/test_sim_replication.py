"""The simulator publishes through the real replication writer over TCP."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

from federation_sender.clock import SystemClock
from federation_sender.replication import commands as c
from federation_sender.sim.driver import Driver, Scenario
from federation_sender.sim.publish import (
    EVENTS,
    TO_DEVICE,
    WriterPublisher,
    serve_replication,
)
from federation_sender.storage.engine import create_engine
from federation_sender.storage.migrate import upgrade


async def _read_until(
    reader: asyncio.StreamReader, done: Callable[[list[c.Command]], bool]
) -> list[c.Command]:
    got: list[c.Command] = []
    async with asyncio.timeout(10):
        while not done(got):
            line = await reader.readline()
            assert line, "server closed the connection"
            got.append(c.parse_line(line.decode().rstrip("\n")))
    return got


async def test_tcp_reader_sees_rdata_for_every_event(tmp_path: Path) -> None:
    clock = SystemClock()
    engine = create_engine(f"sqlite:///{tmp_path}/repl.db")
    await upgrade(engine)
    try:
        publisher = await WriterPublisher.for_database(engine, "us.test")
        async with serve_replication(publisher.writer, transport="tcp", clock=clock) as port:
            assert port
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"NAME sim-test\nREPLICATE\n")
            await writer.drain()
            hello = await _read_until(
                reader,
                lambda got: sum(isinstance(x, c.PositionCommand) for x in got) >= 3,
            )
            assert isinstance(hello[0], c.ServerCommand) and hello[0].server_name == "us.test"

            scenario = Scenario(
                server_name="us.test", rooms=2, partial_state_rooms=1, steps=100,
                rate_per_s=None,
            )  # fmt: skip
            driver = Driver.build(scenario, engine=engine, publisher=publisher, clock=clock)
            await driver.setup()
            await driver.run()
            last = driver.progress.last_stream_ordering
            to_device = driver.progress.to_device

            def complete(got: list[c.Command]) -> bool:
                rdata = [x for x in got if isinstance(x, c.RdataCommand)]
                seen_to_device = sum(x.stream_name == TO_DEVICE for x in rdata)
                return last in {x.token for x in rdata} and seen_to_device == to_device

            got = await _read_until(reader, complete)
            writer.close()
            await writer.wait_closed()
        rdata = [x for x in got if isinstance(x, c.RdataCommand)]
        events = [x for x in rdata if x.stream_name == EVENTS]
        assert [x.token for x in events] == list(range(1, last + 1))
        ids = {x.row[1][0] for x in events}  # type: ignore[index]
        assert ids == set(driver.oracle.events_by_id)
        assert to_device > 0
    finally:
        await engine.dispose()
