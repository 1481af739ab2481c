"""Presence states, rooms, hosts and event metadata read from a real Synapse 1.163's
tables: what main publishes on the presence stream (a long status message included), and
the receipt hosts of a partial-state room."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import random
import urllib.parse
from collections.abc import AsyncIterator

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from federation_sender.clock import SystemClock
from federation_sender.intake.streams import ROW_PARSERS, parse_row
from federation_sender.replication.client import ReplicationClient
from federation_sender.replication.commands import MAX_LINE_BYTES
from federation_sender.replication.reconnect import Backoff
from federation_sender.replication.redis import RedisTransport
from federation_sender.replication.rows import PresenceRow
from federation_sender.storage.capabilities import EduRooms
from federation_sender.storage.synapse.backend import SynapseBackend
from federation_sender.storage.synapse.database import create_synapse_engine
from federation_sender.storage.synapse.stream_fetchers import synapse_fetchers
from federation_sender.synapse.config import SynapseConfig
from federation_sender.testing.replication import InMemoryPositionStore, RecordingHandler
from federation_sender.testing.replication_tap import ReplicationTap
from federation_sender.testing.synapse_deployment import SynapseDeployment

_names = itertools.count()


def edu_rooms(engine: AsyncEngine, server_name: str) -> EduRooms:
    """The Synapse backend's rooms, as it offers them to the EDU fan-outs."""
    syn = SynapseConfig(
        server_name=server_name, database_url="", redis_url="", signing_key_path="",
        worker_name="fed1", federation_sender_instances=("fed1",),
        federation_domain_whitelist=None, ip_range_blacklist=(), ip_range_whitelist=(),
        verify_tls=True, extra_ca_file=None, min_retry_interval_ms=600_000,
        retry_multiplier=2.0, max_retry_interval_ms=7 * 86_400_000,
    )
    rooms = SynapseBackend(engine, syn, "fed1", SystemClock()).capabilities().edu_rooms
    assert rooms is not None
    return rooms


@pytest.fixture
async def engine(synapse_deployment: SynapseDeployment) -> AsyncIterator[AsyncEngine]:
    eng = create_synapse_engine(synapse_deployment.database_url, pool_size=2)
    yield eng
    await eng.dispose()


def presence_rows(lines: list[str], user_id: str) -> list[tuple[int, PresenceRow]]:
    out = []
    for line in lines:
        parts = line.split(" ", 4)
        if parts[:2] == ["RDATA", "presence"] and parts[3] != "batch":
            row = parse_row("presence", json.loads(parts[4]))
            assert isinstance(row, PresenceRow)
            if row.state.user_id == user_id:
                out.append((int(parts[3]), row))
    return out


async def test_presence_source_reads_what_main_published(
    synapse_deployment: SynapseDeployment, engine: AsyncEngine
) -> None:
    d = synapse_deployment
    alice = d.client.register(f"pr_alice{next(_names)}")
    room = d.client.create_room(alice)
    path = f"/_matrix/client/v3/presence/{urllib.parse.quote(alice.user_id)}/status"
    with ReplicationTap(d.redis_url, d.server_name) as tap:
        d.client.call("PUT", path, {"presence": "unavailable", "status_msg": "lunch"},
                      alice.access_token)
        tap.wait_for(lambda lines: any(r.state.status_msg == "lunch"
                                       for _, r in presence_rows(lines, alice.user_id)),
                     what="alice's presence")
        token, live = [(t, r) for t, r in presence_rows(tap.lines, alice.user_id)
                       if r.state.status_msg == "lunch"][-1]
    source = edu_rooms(engine, d.server_name)
    stored = await source.states_for_users([alice.user_id, "@nobody:nowhere"])
    assert stored == {alice.user_id: live.state}
    assert live.state in await source.startup_states()
    assert await source.rooms_for_user(alice.user_id) == [room]
    assert await source.current_hosts(room) == {d.server_name}
    # A gap in the presence stream is read back from presence_stream.
    fetcher = synapse_fetchers(engine)["presence"]
    rows, upto, limited = await fetcher.fetch("master", token - 1, token, 100)
    assert (rows, upto, limited) == ([(token, live)], token, False)


async def test_receipt_hosts_and_event_metadata(
    synapse_deployment: SynapseDeployment, engine: AsyncEngine
) -> None:
    d = synapse_deployment
    alice = d.client.register(f"pr_alice{next(_names)}")
    room = d.client.create_room(alice)
    event_id = d.client.send_message(alice, room, "hello")
    rooms = edu_rooms(engine, d.server_name)
    meta = await rooms.event_meta(room, event_id)
    assert meta is not None and meta.sender == alice.user_id
    received = int(d.sql(f"SELECT received_ts FROM events WHERE event_id = '{event_id}'"))
    assert meta.received_ts == received and await rooms.event_meta(room, "$nope") is None
    assert await rooms.receipt_hosts(room) == {d.server_name}
    # While a room is partially joined, receipts also go to the servers at our join.
    d.sql(f"INSERT INTO partial_state_rooms (room_id) VALUES ('{room}')")
    d.sql(f"INSERT INTO partial_state_rooms_servers VALUES ('{room}', 'far.test')")
    try:
        assert await rooms.receipt_hosts(room) == {d.server_name, "far.test"}
        assert await rooms.current_hosts(room) == {d.server_name}
    finally:
        d.sql(f"DELETE FROM partial_state_rooms_servers WHERE room_id = '{room}'")
        d.sql(f"DELETE FROM partial_state_rooms WHERE room_id = '{room}'")


async def test_a_100_kb_presence_line_from_synapse_is_handled(
    synapse_deployment: SynapseDeployment,
) -> None:
    """Synapse does not limit a status message: a 100 kB one makes main publish a
    presence line six times Synapse's own 16 KiB TCP limit on Redis. Our reader on the
    channel handles it on the same subscription (it used to drop the subscription)."""
    d = synapse_deployment
    alice = d.client.register(f"pr_long{next(_names)}")
    status = ("a long status message, ünïcödé included. " * 2_500)[:100_000]
    clock = SystemClock()
    handler = RecordingHandler()
    client = ReplicationClient(
        RedisTransport(d.redis_url, d.server_name, clock=clock),
        instance_name=f"presence_reader{next(_names)}",
        store=InMemoryPositionStore(),
        fetchers={},
        handler=handler,
        clock=clock,
        rng=random.Random(1),
        streams={"presence": ROW_PARSERS["presence"]},
        backoff=Backoff(0.01, 0.05),
    )
    path = f"/_matrix/client/v3/presence/{urllib.parse.quote(alice.user_id)}/status"

    def received() -> bool:
        return any(isinstance(r, PresenceRow) and r.state.status_msg == status
                   and r.state.user_id == alice.user_id for r in handler.rows("presence"))

    task = asyncio.create_task(client.run())
    try:
        await asyncio.wait_for(client.connected.wait(), 30)
        with ReplicationTap(d.redis_url, d.server_name) as tap:
            await asyncio.to_thread(d.client.call, "PUT", path,
                                    {"presence": "online", "status_msg": status},
                                    alice.access_token)
            await handler.wait_for(received, timeout_s=30)

            def published(lines: list[str]) -> bool:
                return any(x.startswith("RDATA presence ") and alice.user_id in x
                           for x in lines)

            await asyncio.to_thread(tap.wait_for, published, what="the presence line")
            line = [x for x in tap.lines if published([x])][-1]
        assert len(line.encode()) > 100_000 > 6 * MAX_LINE_BYTES
        assert client.sessions_opened == 1
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
