"""The oracle and the worker's fan-out, computed independently, agree on the sim's rows.

The oracle derives each event's destinations from the world model in memory; the
worker derives them from ``room_memberships`` in SQL (the native backend's
``RoomHostsReader``) and its recipient rule. If these ever disagree, either the
simulator writes rows that do not mean what the model says or one side has the rule
wrong -- and the demo's delivery check would be comparing against the wrong thing.
"""

from __future__ import annotations

from collections import defaultdict

from sqlalchemy.ext.asyncio import AsyncEngine

from federation_sender.model import EventRow
from federation_sender.queue.core.catchup import is_sendable
from federation_sender.queue.fanout import recipients
from federation_sender.sim.driver import Driver, OperationMix, Scenario
from federation_sender.sim.publish import RecordingPublisher
from federation_sender.storage.backend import NativeBackend
from federation_sender.storage.protocols import Tx
from federation_sender.testing.clock import FakeClock

US = "us.test"


async def test_worker_fan_out_matches_oracle(engine: AsyncEngine, clock: FakeClock) -> None:
    scenario = Scenario(
        server_name=US, remote_servers=8, rooms=6, partial_state_rooms=2, users_per_room=8,
        servers_per_room=4, users_per_server=3, steps=800, rate_per_s=None, batch_size=64,
        seed=11, mix=OperationMix(join=0.1, leave=0.08, kick=0.05, ban=0.02, outlier=0.02),
    )  # fmt: skip
    driver = Driver.build(scenario, engine=engine, publisher=RecordingPublisher(), clock=clock)
    await driver.setup()
    await driver.run()

    oracle_hosts: dict[str, set[str]] = defaultdict(set)
    for dest, exp in driver.oracle.destinations.items():
        for expected in exp.should_receive:
            oracle_hosts[expected.event_id].add(dest)

    worker_hosts: dict[str, set[str]] = {}

    async def read(
        tx: Tx,
    ) -> tuple[list[EventRow], dict[str, list[EventRow]], dict[str, list[frozenset[str]]]]:
        rows = await tx.events.events_after(0, driver.progress.last_stream_ordering, 100_000)
        by_room: dict[str, list[EventRow]] = defaultdict(list)
        for e in rows:
            if is_sendable(e, US):
                by_room[e.room_id].append(e)
        return rows, by_room, await tx.hosts.hosts_for_events(by_room)

    rows, by_room, hosts_by_room = await NativeBackend(engine).run(read)
    sendable = [e for e in rows if is_sendable(e, US)]
    index = {
        room: dict(zip((e.stream_ordering for e in evs), hosts_by_room[room], strict=True))
        for room, evs in by_room.items()
    }
    for e in sendable:
        hosts = recipients(index[e.room_id][e.stream_ordering], US, lambda _d: True)
        if hosts:
            worker_hosts[e.event_id] = set(hosts)

    assert len(rows) == driver.progress.events
    assert len(sendable) < len(rows)  # remote events and outliers were written too
    assert worker_hosts == dict(oracle_hosts)
    assert len(worker_hosts) > 300
