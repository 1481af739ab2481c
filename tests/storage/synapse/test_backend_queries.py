"""The Synapse backend's reads and writes, checked against Synapse itself.

On the session's Synapse 1.163 (main only: no sender is needed for what is checked
here), with peers that joined a room over federation: our wire PDUs equal what
Synapse's own event class gives for the same rows; the hosts we compute from state
groups equal the answers main cached in Redis for the same events; relayed joins are
sendable and never go back to the joiner. On an empty Synapse schema: the
``federation_stream_position`` reset and saves, and the retry-timings upsert with its
invalidation rows and signals.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
import redis.asyncio as aioredis
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from federation_sender.ids import server_of
from federation_sender.model import EventRow
from federation_sender.queue.core.catchup import is_sendable
from federation_sender.queue.persistence import QueuePersistence
from federation_sender.replication import commands as c
from federation_sender.storage.synapse.backend import SynapseBackend
from federation_sender.storage.synapse.database import create_synapse_engine
from federation_sender.storage.synapse.hosts import RedisExternalCache, StateGroupHostsCache
from federation_sender.synapse.config import SynapseConfig
from federation_sender.testing.clock import FakeClock
from federation_sender.testing.synapse_client import User
from federation_sender.testing.synapse_deployment import SynapseDeployment
from federation_sender.testing.synapse_install import synapse_python
from federation_sender.testing.synapse_peer import FederationPeer, PeerNetwork
from tests.synapse.backend_support import (  # noqa: F401
    synapse_db_url_fixture,
    synapse_engine_fixture,
    synapse_template_fixture,
)

pytestmark = pytest.mark.postgres

INSTANCE = "fed1"


def _syn(server_name: str, instances: tuple[str, ...] = (INSTANCE,)) -> SynapseConfig:
    return SynapseConfig(
        server_name=server_name,
        database_url="",
        redis_url="",
        signing_key_path="",
        worker_name=INSTANCE,
        federation_sender_instances=instances,
        federation_domain_whitelist=None,
        ip_range_blacklist=(),
        ip_range_whitelist=(),
        verify_tls=True,
        extra_ca_file=None,
        min_retry_interval_ms=600_000,
        retry_multiplier=2.0,
        max_retry_interval_ms=7 * 86_400_000,
    )


# --- on the session's Synapse ------------------------------------------------------------


@dataclass
class Room:
    room_id: str
    alice: User
    peers: list[FederationPeer]
    join_ids: list[str]



@pytest.fixture(scope="module")
def room(synapse_deployment: SynapseDeployment, network: PeerNetwork) -> Room:
    """Membership changing between messages: peers join, a local user joins and
    leaves, the last peer's user is banned, messages in between (each change is a new
    state group)."""
    d = synapse_deployment
    alice = d.client.register(f"alice_{uuid.uuid4().hex[:8]}")
    bob = d.client.register(f"bob_{uuid.uuid4().hex[:8]}")
    room_id = d.client.create_room(alice)
    peers = network.add_peers(3)
    joins: list[str] = []
    for i, p in enumerate(peers):
        joins.append(network.join(p, room_id, d.server_name).join_event_id)
        d.client.send_message(alice, room_id, f"after join {i}")
    d.client.join(bob, room_id)
    d.client.send_message(bob, room_id, "bob is here")
    d.client.call("POST", f"/_matrix/client/v3/rooms/{room_id}/leave", {}, bob.access_token)
    d.client.send_message(alice, room_id, "bob left")
    banned = peers[-1].user_id()
    d.client.call(
        "POST", f"/_matrix/client/v3/rooms/{room_id}/ban", {"user_id": banned}, alice.access_token
    )
    d.client.send_message(alice, room_id, "after the ban")
    return Room(room_id, alice, peers, joins)


@pytest.fixture
async def deployment_backend(
    synapse_deployment: SynapseDeployment,
) -> AsyncIterator[SynapseBackend]:
    d = synapse_deployment
    engine = create_synapse_engine(d.database_url)
    yield SynapseBackend(engine, _syn(d.server_name), INSTANCE, FakeClock())
    await engine.dispose()


async def _room_events(backend: SynapseBackend, room_id: str) -> list:  # type: ignore[type-arg]
    async def fn(tx):  # type: ignore[no-untyped-def]
        got = await tx.events.room_events_between([room_id], -1, 2**62, 10_000)
        return got.get(room_id, [])

    return await backend.run(fn)  # type: ignore[no-any-return]


_GET_PDU_JSON = """
import json, sys
from synapse.api.room_versions import KNOWN_ROOM_VERSIONS
from synapse.events import make_event_from_dict
out = {}
for version, event_json, internal in json.load(sys.stdin):
    ev = make_event_from_dict(json.loads(event_json), KNOWN_ROOM_VERSIONS[version],
                              json.loads(internal))
    out[ev.event_id] = ev.get_pdu_json()
json.dump(out, sys.stdout)
"""


async def test_backend_wire_pdu_equals_synapses_get_pdu_json(
    synapse_deployment: SynapseDeployment, room: Room, deployment_backend: SynapseBackend
) -> None:
    events = await _room_events(deployment_backend, room.room_id)
    async with deployment_backend.engine.connect() as conn:
        rows = (
            await conn.execute(
                text(
                    "SELECT r.room_version, j.json, j.internal_metadata FROM event_json j "
                    "JOIN rooms r USING (room_id) WHERE j.room_id = :r"
                ),
                {"r": room.room_id},
            )
        ).all()
    done = subprocess.run(  # noqa: ASYNC221 - a test's one-off call into Synapse's venv
        [str(synapse_python()), "-c", _GET_PDU_JSON],
        input=json.dumps([list(r) for r in rows]),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    theirs = json.loads(done.stdout)
    assert len(events) == len(rows) > 10
    for e in events:
        assert json.loads(e.json) == theirs[e.event_id], e.event_id


async def test_backend_hosts_from_state_groups_equal_synapses(
    synapse_deployment: SynapseDeployment, room: Room, deployment_backend: SynapseBackend
) -> None:
    """Main caches its own answer (the resolved state before each event it creates) in
    Redis; the database path must give the same hosts for the same events."""
    d = synapse_deployment
    events = [e for e in await _room_events(deployment_backend, room.room_id) if not e.outlier]
    client = aioredis.Redis.from_url(d.redis_url)
    try:
        cache = RedisExternalCache(client)
        sgs = await cache.get_many("event_to_prev_state_group", [e.event_id for e in events])
        cached = await cache.get_many("get_joined_hosts", [str(g) for g in sgs])
    finally:
        await client.aclose()
    expected = {
        e.event_id: frozenset(h)
        for e, h in zip(events, cached, strict=True)
        if isinstance(h, list)
    }
    assert len(expected) >= 8  # messages, state, bob's join and leave

    async def fn(tx):  # type: ignore[no-untyped-def]
        return await tx.hosts.hosts_for_events({room.room_id: events})

    answers = (await deployment_backend.run(fn))[room.room_id]
    ours = dict(zip([e.event_id for e in events], answers, strict=True))
    for eid, hosts in expected.items():
        assert ours[eid] == hosts, eid
    # The ban reaches the banned server (the state before it); the next message does not.
    ban, after = events[-2], events[-1]
    banned = room.peers[-1].server_name
    assert ban.type == "m.room.member" and banned in ours[ban.event_id]
    assert banned not in ours[after.event_id]
    assert {p.server_name for p in room.peers[:-1]} <= ours[after.event_id]
    assert deployment_backend.groups.misses > 0  # answered from the database


async def test_backend_relayed_joins_are_sent_but_not_back(
    synapse_deployment: SynapseDeployment, room: Room, deployment_backend: SynapseBackend
) -> None:
    d = synapse_deployment
    events = await _room_events(deployment_backend, room.room_id)
    by_id = {e.event_id: e for e in events}
    joins = [by_id[j] for j in room.join_ids]

    async def fn(tx):  # type: ignore[no-untyped-def]
        return await tx.hosts.hosts_for_events({room.room_id: joins})

    hosts = (await deployment_backend.run(fn))[room.room_id]
    for i, (join, peer) in enumerate(zip(joins, room.peers, strict=True)):
        assert join.send_on_behalf_of == peer.server_name
        assert server_of(join.sender) == peer.server_name
        assert is_sendable(join, d.server_name)
        assert peer.server_name not in hosts[i]
        assert {p.server_name for p in room.peers[:i]} <= hosts[i]
    # Remote-origin events without send_on_behalf_of stay unsent: none of the peers'
    # events is a local one.
    assert all(is_sendable(e, d.server_name) == (
        server_of(e.sender) == d.server_name or e.send_on_behalf_of is not None
    ) for e in events if not e.outlier and not e.rejected)


# --- on an empty Synapse schema -------------------------------------------------------------


async def test_backend_federation_stream_position_reset_and_saves(
    synapse_engine: AsyncEngine,
) -> None:
    async with synapse_engine.begin() as conn:
        await conn.execute(text("DELETE FROM federation_stream_position"))
        await conn.execute(
            text(
                "INSERT INTO federation_stream_position (type, stream_id, instance_name) "
                "VALUES ('events', 40, 'master'), ('federation', 3, 'master'), "
                "('events', 55, 'old'), ('federation', 7, 'old')"
            )
        )
    backend = SynapseBackend(synapse_engine, _syn("example.org"), INSTANCE, FakeClock())

    async def load(tx):  # type: ignore[no-untyped-def]
        return (await tx.positions.load("events", INSTANCE),
                await tx.positions.load("federation", INSTANCE))

    # As Synapse's worker at start: the minimum of each type, other instances gone.
    assert await backend.run(load) == (40, 3)
    async with synapse_engine.connect() as conn:
        rows = (await conn.execute(text(
            "SELECT type, stream_id, instance_name FROM federation_stream_position ORDER BY 1"
        ))).all()
    assert [tuple(r) for r in rows] == [("events", 40, INSTANCE), ("federation", 3, INSTANCE)]

    async def save(tx, v):  # type: ignore[no-untyped-def]
        await tx.positions.save("events", INSTANCE, v)

    await backend.run(lambda tx: save(tx, 90))
    await backend.run(lambda tx: save(tx, 60))  # never backwards
    assert (await backend.run(load))[0] == 90


async def test_backend_retry_timings_invalidate_main_and_signal_after_commit(
    synapse_engine: AsyncEngine,
) -> None:
    clock = FakeClock()
    backend = SynapseBackend(synapse_engine, _syn("example.org"), INSTANCE, clock)
    sent: list[c.Command] = []
    signals = backend.capabilities().signals
    assert signals is not None
    signals.attach(lambda cmd: sent.append(cmd) is None)
    d = "remote.example"

    async def set_retry(failure_ts, last_ts, interval):  # type: ignore[no-untyped-def]
        async def fn(tx):  # type: ignore[no-untyped-def]
            await tx.destinations.set_retry_timings(d, failure_ts, last_ts, interval)
            return await tx.destinations.get_destination(d)

        return await backend.run(fn)

    row = await set_retry(1000, 1000, 600_000)
    assert (row.retry_last_ts, row.retry_interval) == (1000, 600_000)
    row = await set_retry(1000, 1000, 300_000)  # shorter, same attempt: kept
    assert row.retry_interval == 600_000
    row = await set_retry(1000, 2000, 300_000)  # a later attempt wins (Synapse's rule)
    assert (row.retry_last_ts, row.retry_interval) == (2000, 300_000)
    row = await set_retry(None, 0, 0)  # it came back
    assert (row.retry_last_ts, row.retry_interval) == (0, 0)
    await set_retry(None, 0, 0)  # already up: not announced again

    async with synapse_engine.connect() as conn:
        inv = (await conn.execute(text(
            "SELECT stream_id, instance_name, cache_func, keys, invalidation_ts "
            "FROM cache_invalidation_stream_by_instance ORDER BY stream_id"
        ))).all()
    assert [tuple(r[1:4]) for r in inv] == [(INSTANCE, "get_destination_retry_timings", [d])] * 5
    # What goes on replication, after each commit: the rows as RDATA, the comeback.
    rdata = [c.RdataCommand("caches", INSTANCE, r[0], [r[2], r[3], r[4]]) for r in inv]
    assert sent == [*rdata[:4], c.RemoteServerUpCommand(d), rdata[4]]

    # A transaction that rolls back signals nothing.
    async def fails(tx):  # type: ignore[no-untyped-def]
        await tx.destinations.set_retry_timings(d, 1, 5000, 600_000)
        raise RuntimeError("rolled back")

    with pytest.raises(RuntimeError):
        await backend.run(fails)
    assert len(sent) == 6

    # Our position, said after connecting and on every REPLICATE.
    pos = inv[-1][0]
    assert list(signals.announce()) == [c.PositionCommand("caches", INSTANCE, pos, pos)]


def _event(
    eid: str, room: str, sender: str, prev: list[str], *, auth: list[str] | None = None,
    type_: str = "m.room.message", state_key: str | None = None,
    content: dict[str, object] | None = None, on_behalf: str | None = None,
) -> EventRow:
    pdu = {"type": type_, "room_id": room, "sender": sender, "prev_events": prev,
           "auth_events": auth or [], "content": content or {}, "depth": 5}
    if state_key is not None:
        pdu["state_key"] = state_key
    return EventRow(1, eid, room, type_, state_key, sender, False, False, json.dumps(pdu),
                    send_on_behalf_of=on_behalf)


async def test_backend_destination_rules_on_synapses_tables(synapse_engine: AsyncEngine) -> None:
    """The rules that need rooms the peers cannot make (a partial-state join, an invite
    to a remote server) on Synapse's schema: no prev events, partial-state servers,
    a rescinded invite, send_on_behalf_of and the domain whitelist."""
    partial, full = "!partial:example.org", "!full:example.org"
    async with synapse_engine.begin() as conn:
        await conn.execute(text(
            "INSERT INTO rooms (room_id, room_version) VALUES (:p, '12'), (:f, '12')"
        ), {"p": partial, "f": full})
        await conn.execute(text("INSERT INTO partial_state_rooms (room_id) VALUES (:r)"),
                           {"r": partial})
        await conn.execute(text(
            "INSERT INTO partial_state_rooms_servers (room_id, server_name) VALUES "
            "(:r, 'a.example'), (:r, 'b.example'), (:r, 'blocked.example')"
        ), {"r": partial})
        await conn.execute(text(
            "INSERT INTO room_memberships (event_id, user_id, sender, room_id, membership) "
            "VALUES ('$invite', '@carol:c.example', '@alice:example.org', :r, 'invite')"
        ), {"r": full})
    syn = dataclasses.replace(
        _syn("example.org"),
        federation_domain_whitelist=frozenset({"a.example", "c.example", "example.org"}),
    )
    backend = SynapseBackend(synapse_engine, syn, INSTANCE, FakeClock())
    create = _event("$create", full, "@alice:example.org", [])
    in_partial = _event("$p1", partial, "@alice:example.org", ["$x"])
    relayed = _event("$j", partial, "@dave:a.example", ["$x"], type_="m.room.member",
                     state_key="@dave:a.example", content={"membership": "join"},
                     on_behalf="a.example")
    rescind = _event("$leave", full, "@alice:example.org", ["$unknown"], auth=["$invite"],
                     type_="m.room.member", state_key="@carol:c.example",
                     content={"membership": "leave"})

    async def fn(tx):  # type: ignore[no-untyped-def]
        return await tx.hosts.hosts_for_events(
            {full: [create, rescind], partial: [in_partial, relayed]}
        )

    got = await backend.run(fn)
    assert got[full][0] == frozenset()  # no prev events: nobody
    # No prev event with a state group: the room's current hosts (none here), plus the
    # invitee of the rescinded invite.
    assert got[full][1] == frozenset({"c.example"})
    assert got[partial][0] == frozenset({"a.example"})  # whitelist applied
    assert got[partial][1] == frozenset()  # not back to the server it was made through


async def test_backend_catchup_plans_on_synapses_tables(
    synapse_deployment: SynapseDeployment, room: Room, deployment_backend: SynapseBackend
) -> None:
    """Catch-up reads on Synapse's tables: a short gap is replayed in order, a long one
    is the room's forward extremity when the destination was in the room for it, and a
    banned server gets its own ban (the extremity after it is not visible to it)."""
    d = synapse_deployment
    events = [e for e in await _room_events(deployment_backend, room.room_id) if not e.outlier]
    ban, last = events[-2], events[-1]
    member, banned = room.peers[0].server_name, room.peers[-1].server_name
    after = events[-5].stream_ordering
    rows = [
        (member, room.room_id, last.stream_ordering),
        (banned, room.room_id, ban.stream_ordering),
    ]
    await deployment_backend.run(lambda tx: tx.destinations.upsert_destination_rooms(rows))
    store = QueuePersistence(deployment_backend)
    try:
        async def plan(dest: str, gap: int) -> tuple[str, list[str]]:
            (p,) = await store.plan_catchup(dest, d.server_name, after, (after, None), 10, gap)
            return p.mode, [e.event_id for e in p.events]

        replay = [e.event_id for e in events if after < e.stream_ordering <= last.stream_ordering]
        assert await plan(member, 50) == ("gap", replay)
        assert await plan(member, 2) == ("extremities", [last.event_id])
        assert await plan(banned, 2) == ("event", [ban.event_id])
    finally:
        async with deployment_backend.engine.begin() as conn:
            await conn.execute(
                text("DELETE FROM destination_rooms WHERE room_id = :r"), {"r": room.room_id}
            )


async def test_backend_unreachable_external_cache_reads_as_misses() -> None:
    client = aioredis.Redis.from_url(
        "redis://127.0.0.1:1/0", socket_timeout=1.0, socket_connect_timeout=1.0
    )
    try:
        cache = RedisExternalCache(client)
        assert await cache.get_many("event_to_prev_state_group", ["$a", "$b"]) == [None, None]
        assert cache.failures == 1
    finally:
        await client.aclose()


async def test_backend_names_destinations_with_outbox_rows(synapse_engine: AsyncEngine) -> None:
    """The gathered first read asks which destinations have anything in either outbox
    table: a to-device row or a device-list poke (both deleted once delivered). Past a
    stream token still counts: the per-destination read bounds it."""
    async with synapse_engine.begin() as conn:
        await conn.execute(text(
            "INSERT INTO device_federation_outbox "
            "(destination, stream_id, queued_ts, messages_json, instance_name) VALUES "
            "('td.example', 1, 0, '{}', 'master'), ('both.example', 2, 0, '{}', 'master'),"
            " ('unasked.example', 3, 0, '{}', 'master')"
        ))
        await conn.execute(text(
            "INSERT INTO device_lists_outbound_pokes"
            " (destination, stream_id, user_id, device_id, sent, ts, opentracing_context)"
            " VALUES ('dl.example', 7, '@u:example.org', 'D', false, 0, '{}'),"
            " ('both.example', 8, '@u:example.org', 'D', false, 0, '{}')"
        ))
    backend = SynapseBackend(synapse_engine, _syn("example.org"), INSTANCE, FakeClock())
    names = ["td.example", "dl.example", "both.example", "none.example"]

    async def named(tx):  # type: ignore[no-untyped-def]
        return await tx.outbox.destinations_with_unsent(names)

    try:
        assert await backend.run(named) == {"td.example", "dl.example", "both.example"}
    finally:
        async with synapse_engine.begin() as conn:
            for table in ("device_federation_outbox", "device_lists_outbound_pokes"):
                await conn.execute(text(f"DELETE FROM {table} WHERE destination = ANY(:ds)"),
                                   {"ds": [*names, "unasked.example"]})
    assert await backend.run(named) == set()


async def test_backend_to_device_bounded_by_the_stream_token_and_deleted_by_id(
    synapse_engine: AsyncEngine,
) -> None:
    async with synapse_engine.begin() as conn:
        await conn.execute(text(
            "INSERT INTO device_federation_outbox "
            "(destination, stream_id, queued_ts, messages_json, instance_name) VALUES "
            "('r.example', 1, 0, '{}', 'master'), "
            "('r.example', 2, 0, '{}', 'master'), "
            "('r.example', 3, 0, '{}', 'master')"
        ))
    backend = SynapseBackend(synapse_engine, _syn("example.org"), INSTANCE, FakeClock())

    async def read(tx):  # type: ignore[no-untyped-def]
        td, _dl = await tx.outbox.unsent_outbox("r.example", -1, -1, 10)
        return [r.stream_id for r in td]

    assert await backend.run(read) == [1, 2, 3]  # no token announced yet
    backend.capabilities().bind_stream_tokens({"to_device": 2})
    assert await backend.run(read) == [1, 2]  # 3 may sit above a row not yet committed

    async def ack(tx):  # type: ignore[no-untyped-def]
        await tx.outbox.ack_to_device("r.example", [2], 0)

    await backend.run(ack)
    assert await backend.run(read) == [1]


def test_backend_state_group_cache_is_bounded_and_shares_equal_sets() -> None:
    cache = StateGroupHostsCache(max_groups=100, max_hosts=10)
    a = cache.put(1, frozenset({"a.example", "b.example"}))
    b = cache.put(2, frozenset({"a.example", "b.example"}))
    assert a is b  # consecutive groups with the same hosts share one set
    cache.put(3, frozenset(f"h{i}.example" for i in range(8)))
    assert cache.get(1) is None and len(cache) == 2  # 2 + 2 + 8 hosts > 10: oldest out
    assert cache.get(3) is not None
    cache.put(4, frozenset(f"x{i}.example" for i in range(20)))  # alone over the bound
    assert len(cache) == 1 and cache.get(4) is not None
