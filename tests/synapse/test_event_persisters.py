"""Our worker beside a Synapse 1.163 whose events are persisted by two workers.

Main, ``persister1`` and ``persister2`` (``stream_writers.events``, each with its
``instance_map`` entry) and our worker as ``fed1``; fake remote servers joined to six
rooms, three persisted by each persister. Messages go into every room at once, so both
persisters allocate stream orderings from the one sequence and commit out of order
with each other. Every event must reach every destination exactly once, also across a
restart of our worker in the middle of it, and the positions it stores must never pass
an event it has not fanned out (issue 34 item 1: reading up to the highest token any
writer reported skipped an event committed late by the other writer, for good).
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from federation_sender.testing.certs import LoopbackCA
from federation_sender.testing.postgres import PostgresCluster
from federation_sender.testing.redis_server import ephemeral_redis
from federation_sender.testing.synapse_client import User
from federation_sender.testing.synapse_config import RedisAddress
from federation_sender.testing.synapse_deployment import (
    SynapseDeployment,
    create_deployment,
    event_writer,
)
from federation_sender.testing.synapse_peer import FederationPeer, PeerNetwork
from tests.synapse.backend_support import OurWorker

pytestmark = pytest.mark.postgres

ROOMS_PER_PERSISTER = 3
N_PEERS = 2
PER_ROOM = 60
SENDERS_PER_ROOM = 3
"""6 rooms x 60 = 360 messages, sent 18 at a time (three senders per room)."""


@dataclass
class Scene:
    d: SynapseDeployment
    ours: OurWorker
    alice: User
    rooms: dict[str, str]
    """room id -> its persister."""
    peers: list[FederationPeer]


@pytest.fixture(scope="module")
def persisted_by_two(
    pg_cluster: PostgresCluster, loopback_ca: LoopbackCA, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SynapseDeployment]:
    """A deployment of its own (and a Redis of its own: see tests/conftest.py)."""
    with ephemeral_redis() as redis_server:
        d = create_deployment(
            tmp_path_factory.mktemp("synapse-persisters"),
            ca=loopback_ca,
            cluster=pg_cluster,
            database_name="synapse_persisters",
            redis=RedisAddress(redis_server.host, redis_server.port),
            event_persisters=2,
        )
        d.start()
        try:
            yield d
        finally:
            d.stop()


@pytest.fixture(scope="module")
def scene(
    persisted_by_two: SynapseDeployment,
    network: PeerNetwork,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Scene]:
    d = persisted_by_two
    ours = OurWorker(d, tmp_path_factory.mktemp("ours"))
    ours.start()
    alice = d.client.register(f"alice_{uuid.uuid4().hex[:8]}")
    # How many rooms it takes depends on how their IDs hash to the persisters.
    admin = d.client.register(f"admin_{uuid.uuid4().hex[:8]}", admin=True)
    d.client.exempt_from_ratelimits(admin, alice)
    rooms: dict[str, str] = {}
    per = dict.fromkeys(d.event_writers, 0)
    while min(per.values()) < ROOMS_PER_PERSISTER:
        room_id = d.client.create_room(alice)
        writer = event_writer(room_id, d.event_writers)
        if per[writer] < ROOMS_PER_PERSISTER:
            per[writer] += 1
            rooms[room_id] = writer
    peers = network.add_peers(N_PEERS)
    for room_id in rooms:
        for p in peers:
            network.join(p, room_id, d.server_name)
    try:
        yield Scene(d, ours, alice, rooms, peers)
    finally:
        ours.stop()


def stored_positions(d: SynapseDeployment) -> tuple[int, dict[str, int]]:
    """Our intake's stored events position and the replication client's per writer."""
    intake = int(d.sql(
        "SELECT stream_id FROM federation_stream_position "
        f"WHERE type = 'events' AND instance_name = '{d.instance_name}'"
    ))  # fmt: skip
    rows = d.sql(
        "SELECT instance_name, stream_id FROM federation_sender.replication_positions "
        f"WHERE stream_name = '{d.instance_name}:events'"
    )
    per_writer = {
        name: int(v) for name, v in (ln.split("|") for ln in rows.splitlines() if ln)
    }
    return intake, per_writer


def orderings(d: SynapseDeployment, event_ids: list[str]) -> dict[str, int]:
    rows = d.sql(
        "SELECT event_id, stream_ordering FROM events WHERE event_id IN ("
        + ", ".join(f"'{e}'" for e in event_ids) + ")"
    )
    return {e: int(o) for e, o in (ln.split("|") for ln in rows.splitlines() if ln)}


def last_successful(d: SynapseDeployment, destination: str) -> int:
    v = d.sql(
        "SELECT last_successful_stream_ordering FROM destinations "
        f"WHERE destination = '{destination}'"
    ).strip()
    return int(v) if v else 0


def test_two_persisters_every_event_once_across_a_restart(
    scene: Scene, network: PeerNetwork
) -> None:
    d, ours = scene.d, scene.ours
    sent: dict[str, list[str]] = {r: [] for r in scene.rooms}
    errors: list[BaseException] = []

    def send_room(room_id: str, thread: int) -> None:
        try:
            for i in range(PER_ROOM // SENDERS_PER_ROOM):
                eid = d.client.send_message(scene.alice, room_id, f"m{thread}.{i}")
                sent[room_id].append(eid)
        except BaseException as e:  # reported by the test thread
            errors.append(e)

    def delivered() -> int:
        got = scene.peers[0].event_counts()
        return sum(1 for ids in sent.values() for e in list(ids) if e in got)

    threads = [
        threading.Thread(target=send_room, args=(r, i), daemon=True)
        for r in scene.rooms
        for i in range(SENDERS_PER_ROOM)
    ]
    for t in threads:
        t.start()
    total = PER_ROOM * len(scene.rooms)
    network.wait_for(lambda: delivered() >= total // 3, what="a third of the messages")

    # Restart in the middle. What is stored at the stop must not have passed an event
    # that was not delivered: a destination resumes (catch-up) above its
    # last_successful_stream_ordering, so every event at or below it must be there
    # already; the intake resumes above its position, so every event at or below it
    # must be delivered or above that mark (caught up from destination_rooms).
    ours.stop()
    intake, per_writer = stored_positions(d)
    assert set(per_writer) == set(d.event_writers), per_writer
    so = orderings(d, [e for ids in sent.values() for e in list(ids)])
    lost_at_stop: list[tuple[str, int, int, str]] = []
    for p in scene.peers:
        done = last_successful(d, p.server_name)
        got = p.event_counts()
        lost_at_stop += [
            (p.server_name, done, intake, e)
            for e, o in so.items()
            if o <= min(done, intake) and got[e] == 0
        ]
    ours.start()

    for t in threads:
        t.join(timeout=120)
    assert not errors and all(len(ids) == PER_ROOM for ids in sent.values()), errors
    # One more message per room: every peer has it only once all before it arrived
    # (one transaction in flight per destination, PDUs in stream order).
    fences = {r: d.client.send_message(scene.alice, r, "fence") for r in scene.rooms}
    try:
        network.wait_for(
            lambda: all(
                fences[r] in p.event_counts(r) for p in scene.peers for r in scene.rooms
            ),
            timeout_s=60,
            what="the fences at every peer",
        )
    finally:
        missing, twice = [], []
        for p in scene.peers:
            for r, ids in sent.items():
                counts = p.event_counts(r)
                missing += [(p.server_name, e) for e in ids if counts[e] == 0]
                twice += [(p.server_name, e) for e in ids if counts[e] > 1]
        print(f"events sent {total} to {len(scene.peers)} peers: "
              f"{len(missing)} (event, peer) pairs missing, {len(twice)} twice; "
              f"{len(lost_at_stop)} below the stored positions at the restart")
    assert lost_at_stop == []
    assert (missing, twice) == ([], [])
    # Both persisters wrote, interleaved in the one sequence.
    writers = d.sql(
        "SELECT DISTINCT instance_name FROM events WHERE room_id IN ("
        + ", ".join(f"'{r}'" for r in scene.rooms) + ")"
    ).split()
    assert sorted(writers) == sorted(d.event_writers)
    # At rest, everything is read: the intake's position is the end of the stream.
    assert stored_positions(d)[0] >= max(orderings(d, list(fences.values())).values())
    assert ours.running
    assert "went backwards" not in Path(ours.log_path).read_text(errors="replace")


def test_one_persister_down_the_other_rooms_flow_across_a_restart(
    scene: Scene, network: PeerNetwork
) -> None:
    """persister2 stops (its rooms wait in Synapse); the rooms of persister1 keep being
    delivered, also after a restart of our worker while persister2 is down (what
    persister1 wrote while we were away is read back from the events table, as
    Synapse's generator does); then persister2 comes back and everything arrives once."""
    d, ours = scene.d, scene.ours
    down = d.persisters[1]
    up_rooms = [r for r, w in scene.rooms.items() if w != down.name]
    down.stop()
    try:
        ours.stop()
        sent = [d.client.send_message(scene.alice, r, f"away {i}")
                for i in range(4) for r in up_rooms]  # fmt: skip
        ours.start()
        sent += [d.client.send_message(scene.alice, r, f"back {i}")
                 for i in range(4) for r in up_rooms]  # fmt: skip
        network.wait_for(
            lambda: all(e in p.event_counts() for p in scene.peers for e in sent),
            timeout_s=30,
            what="persister1's rooms delivered while persister2 is down",
        )
    finally:
        down.start()
    fences = [d.client.send_message(scene.alice, r, "fence 2") for r in scene.rooms]
    network.wait_for(
        lambda: all(e in p.event_counts() for p in scene.peers for e in fences),
        timeout_s=60,
        what="the fences at every peer",
    )
    for p in scene.peers:
        counts = p.event_counts()
        assert [counts[e] for e in sent] == [1] * len(sent), p.server_name
