"""Our worker as the federation sender of a real Synapse 1.163 deployment.

Synapse main runs on PostgreSQL and Redis with ``federation_sender_instances: [fed1]``;
our worker runs as ``fed1`` from Synapse's own configuration files; fake remote
servers join main's rooms over federation (make_join/send_join, signed) and record
what they receive. Covered: every event reaches every joined server once; joins made
through main are relayed to the others (not back to the joiner); a crash in the
middle of a spike loses nothing; the handover from our worker to Synapse's and back,
with events persisted while neither runs, delivers everything (our worker resumes from
``federation_stream_position``); a destination that contacts main is woken within a
second; our retry timings reach main as cache invalidations.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass

import pytest
import redis

from federation_sender.testing.replication_tap import ReplicationTap, cache_invalidations
from federation_sender.testing.synapse_client import User
from federation_sender.testing.synapse_deployment import SynapseDeployment
from federation_sender.testing.synapse_peer import FederationPeer, JoinedRoom, PeerNetwork
from tests.synapse.backend_support import OurWorker

pytestmark = pytest.mark.postgres

N_PEERS = 3
SPIKE = 40


@dataclass
class Room:
    room_id: str
    alice: User
    peers: list[FederationPeer]
    joins: list[JoinedRoom]




@pytest.fixture(scope="module")
def room(ours: OurWorker, network: PeerNetwork) -> Room:
    d = ours.d
    alice = d.client.register(f"alice_{uuid.uuid4().hex[:8]}")
    room_id = d.client.create_room(alice)
    peers = network.add_peers(N_PEERS)
    joins = [network.join(p, room_id, d.server_name) for p in peers]
    return Room(room_id, alice, peers, joins)


def send(d: SynapseDeployment, room: Room, n: int, tag: str) -> list[str]:
    return [d.client.send_message(room.alice, room.room_id, f"{tag} {i}") for i in range(n)]


def fence(d: SynapseDeployment, net: PeerNetwork, room: Room, timeout_s: float = 60.0) -> str:
    """A last message; returns once it reached every peer. One transaction is in flight
    per destination and PDUs go in stream order, so what was sent before it and was
    going to arrive has arrived (catch-up after a restart included)."""
    eid = d.client.send_message(room.alice, room.room_id, "fence")
    net.wait_for(
        lambda: all(eid in p.event_counts(room.room_id) for p in room.peers),
        timeout_s=timeout_s,
        what="the fence at every peer",
    )
    return eid


def test_backend_events_reach_every_destination_once(
    ours: OurWorker, network: PeerNetwork, room: Room
) -> None:
    ids = send(ours.d, room, 10, "once")
    fence(ours.d, network, room)
    # As a Synapse process writing ``caches``: a REPLICATE is answered with our position.
    with ReplicationTap(ours.d.redis_url, ours.d.server_name) as tap:
        publisher = redis.Redis.from_url(ours.d.redis_url)
        publisher.publish(ours.d.server_name, "REPLICATE ")
        publisher.close()
        tap.wait_for(
            lambda lines: any(ln.startswith(f"POSITION caches {ours.d.instance_name} ")
                              for ln in lines),
            what="our POSITION caches in answer to REPLICATE",
        )
    for peer in room.peers:
        counts = peer.event_counts(room.room_id)
        assert {e: counts[e] for e in ids} == dict.fromkeys(ids, 1), peer.server_name
        assert peer.rejected == []  # signed with Synapse's key, verified by the peer
    assert ours.running


def test_backend_relayed_joins(ours: OurWorker, network: PeerNetwork, room: Room) -> None:
    fence(ours.d, network, room)
    for i, peer in enumerate(room.peers):
        counts = peer.event_counts(room.room_id)
        later = [j.join_event_id for j in room.joins[i + 1 :]]
        assert [counts[j] for j in later] == [1] * len(later), peer.server_name
        assert counts[room.joins[i].join_event_id] == 0  # never back to the joiner


def test_backend_restart_mid_spike_loses_nothing(
    ours: OurWorker, network: PeerNetwork, room: Room
) -> None:
    """SIGKILL while a spike is being sent and delivered; the spike goes on while the
    worker is down; after the restart every event reaches every peer."""
    d = ours.d
    sent: list[str] = []

    def send_spike() -> None:
        for i in range(SPIKE):
            sent.append(d.client.send_message(room.alice, room.room_id, f"spike {i}"))

    spike = threading.Thread(target=send_spike, name="spike", daemon=True)
    spike.start()
    network.wait_for(
        lambda: sum(1 for e in sent if e in room.peers[0].event_counts(room.room_id)) >= 5,
        what="the first events of the spike delivered",
    )
    ours.stop(kill=True)
    killed_after = len(sent)
    ours.start()
    spike.join(timeout=120)
    assert killed_after < SPIKE  # the spike was still being sent when the worker died
    assert not spike.is_alive() and len(sent) == SPIKE
    fence(d, network, room)
    for peer in room.peers:
        counts = peer.event_counts(room.room_id)
        assert [e for e in sent if counts[e] == 0] == [], peer.server_name


def test_backend_handover_both_ways(
    ours: OurWorker, network: PeerNetwork, room: Room
) -> None:
    """Ours -> Synapse's -> ours, with events persisted while neither runs each time.

    Synapse's worker starts every destination in catch-up, and while it catches up it
    sends a room's newest event only (receivers fetch the rest through
    ``get_missing_events``; these fake peers do not): of its leg, the fence is what
    every peer must have. Ours replays the missed events of each room in order: every
    event persisted while neither ran arrives."""
    d = ours.d
    ours.stop()
    send(d, room, 4, "neither, before Synapse's")
    d.start_federation_sender()
    try:
        send(d, room, 4, "Synapse's")
        fence(d, network, room)
    finally:
        d.stop_federation_sender()
    gap = send(d, room, 4, "neither, before ours")
    ours.start()
    mine = send(d, room, 4, "ours again")
    fence(d, network, room)
    for peer in room.peers:
        counts = peer.event_counts(room.room_id)
        groups = {"gap": gap, "mine": mine}
        missing = {k: [e for e in v if counts[e] == 0] for k, v in groups.items()}
        assert missing == {k: [] for k in groups}, peer.server_name
    pos = d.sql(
        "SELECT stream_id FROM federation_stream_position "
        f"WHERE type = 'events' AND instance_name = '{d.instance_name}'"
    )
    assert int(pos) >= int(d.sql("SELECT max(stream_ordering) FROM events")) - 50


def test_backend_destination_contacting_main_is_woken_within_a_second(
    ours: OurWorker, network: PeerNetwork
) -> None:
    d = ours.d
    alice = d.client.register(f"alice_{uuid.uuid4().hex[:8]}")
    room_id = d.client.create_room(alice)
    peer = network.add_peer()
    network.join(peer, room_id, d.server_name)
    peer.send_status = 503  # down (a 500 may be one item refused: isolated first)

    def invalidated(tap: ReplicationTap, instance: str) -> bool:
        found = (cache_invalidations(ln, "get_destination_retry_timings") for ln in tap.lines)
        return any(f == (instance, [peer.server_name]) for f in found)

    with ReplicationTap(d.redis_url, d.server_name) as tap:
        missed = d.client.send_message(alice, room_id, "to a server that is down")
        # Our backoff reaches main as Synapse's own sender's would.
        tap.wait_for(lambda _: invalidated(tap, d.instance_name), what="our invalidation")
        retry = (
            "SELECT retry_interval > 0 FROM destinations "
            f"WHERE destination = '{peer.server_name}'"
        )
        assert d.sql(retry).strip() == "t"
        rows = d.sql(
            "SELECT count(*) FROM cache_invalidation_stream_by_instance "
            f"WHERE instance_name = '{d.instance_name}' AND '{peer.server_name}' = ANY(keys)"
        )
        assert int(rows) >= 1
        peer.send_status = 200
        network.send_transaction(peer, d.server_name)  # back, and it talks to main
        tap.wait_for(lambda _: invalidated(tap, "master"), what="main's invalidation")
        seen = time.monotonic()
        network.wait_for(
            lambda: missed in peer.event_counts(room_id), timeout_s=10, what="the missed event"
        )
        woken_after_s = time.monotonic() - seen
    assert woken_after_s < 1.0, f"woken after {woken_after_s:.2f} s"
