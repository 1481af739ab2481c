"""Synapse's own federation_sender worker with peers that joined over federation.

These pin the harness against the reference behaviour that ours is compared with:
three fake remote servers join one room through main (make_join/send_join, signed),
and Synapse's worker delivers what local users send to each of them once; joins that
main accepted for a remote server are relayed to the other servers; a destination
that failed and then contacts main makes main clear its backoff and publish the
``get_destination_retry_timings`` invalidation on Redis.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from federation_sender.testing.replication_tap import ReplicationTap, cache_invalidations
from federation_sender.testing.synapse_client import User
from federation_sender.testing.synapse_deployment import SynapseDeployment
from federation_sender.testing.synapse_peer import FederationPeer, JoinedRoom, PeerNetwork

N_PEERS = 3


@dataclass
class Room:
    room_id: str
    alice: User
    peers: list[FederationPeer]
    joins: list[JoinedRoom]


@pytest.fixture(scope="module")
def own_sender(synapse_deployment: SynapseDeployment) -> Iterator[SynapseDeployment]:
    synapse_deployment.start_federation_sender()
    yield synapse_deployment
    synapse_deployment.stop_federation_sender()



@pytest.fixture(scope="module")
def room(own_sender: SynapseDeployment, network: PeerNetwork) -> Room:
    alice = own_sender.client.register(f"alice_{uuid.uuid4().hex[:8]}")
    room_id = own_sender.client.create_room(alice)
    peers = network.add_peers(N_PEERS)
    joins = [network.join(p, room_id, own_sender.server_name) for p in peers]
    return Room(room_id, alice, peers, joins)


def send_and_fence(d: SynapseDeployment, net: PeerNetwork, room: Room, n: int) -> list[str]:
    """Send ``n`` messages, then a fence; return the ids once the fence reached every
    peer. A destination has one transaction in flight, in order, so anything sent
    before the fence that was going to arrive has arrived."""
    ids = [d.client.send_message(room.alice, room.room_id, f"message {i}") for i in range(n)]
    fence = d.client.send_message(room.alice, room.room_id, "fence")
    net.wait_for(
        lambda: all(fence in p.event_counts(room.room_id) for p in room.peers),
        what="the fence at every peer",
    )
    return ids


def test_messages_reach_every_peer_exactly_once(
    own_sender: SynapseDeployment, network: PeerNetwork, room: Room
) -> None:
    ids = send_and_fence(own_sender, network, room, 10)
    for peer in room.peers:
        counts = peer.event_counts(room.room_id)
        assert {eid: counts[eid] for eid in ids} == dict.fromkeys(ids, 1), peer.server_name
        assert [c for c in counts.values() if c != 1] == [], peer.server_name
        assert peer.rejected == []  # every /send carried a valid signature of main's key
    # The ids the peers computed from the PDUs are the ids Synapse stored.
    stored = own_sender.sql(
        f"SELECT event_id FROM events WHERE room_id = '{room.room_id}' AND type = 'm.room.message'"
    ).split()
    assert set(ids) <= set(stored)


def test_joins_of_remote_servers_are_relayed_to_the_others(
    own_sender: SynapseDeployment, network: PeerNetwork, room: Room
) -> None:
    send_and_fence(own_sender, network, room, 0)
    for i, peer in enumerate(room.peers):
        counts = peer.event_counts(room.room_id)
        later_joins = [j.join_event_id for j in room.joins[i + 1 :]]
        assert [counts[j] for j in later_joins] == [1] * len(later_joins), peer.server_name
        assert counts[room.joins[i].join_event_id] == 0  # never sent back to the joiner


def test_destination_contacting_main_clears_backoff_and_is_published(
    own_sender: SynapseDeployment, network: PeerNetwork
) -> None:
    d = own_sender
    alice = d.client.register(f"alice_{uuid.uuid4().hex[:8]}")
    room_id = d.client.create_room(alice)
    peer = network.add_peer()
    network.join(peer, room_id, d.server_name)
    peer.send_status = 500

    def invalidated_by(instance: str, tap: ReplicationTap) -> bool:
        found = (cache_invalidations(ln, "get_destination_retry_timings") for ln in tap.lines)
        return any(f == (instance, [peer.server_name]) for f in found)

    with ReplicationTap(d.redis_url, d.server_name) as tap:
        d.client.send_message(alice, room_id, "to a server that is down")
        tap.wait_for(lambda _: invalidated_by(d.instance_name, tap), what="sender's backoff")
        row = (
            f"SELECT retry_interval > 0 FROM destinations WHERE destination = '{peer.server_name}'"
        )
        assert d.sql(row).strip() == "t"
        assert peer.refused_transactions >= 1

        peer.send_status = 200
        network.send_transaction(peer, d.server_name)  # the server is back and talks to main
        tap.wait_for(lambda _: invalidated_by("master", tap), what="main's invalidation")
        assert d.sql(row).strip() == "f"


@pytest.mark.parametrize("room_version", ["10", "11"])
def test_older_room_versions(
    own_sender: SynapseDeployment, network: PeerNetwork, room_version: str
) -> None:
    """Joins and event ids under the older redaction rules (v12 is the default above)."""
    d = own_sender
    alice = d.client.register(f"alice_{uuid.uuid4().hex[:8]}")
    room_id = d.client.create_room(alice, room_version=room_version)
    peer = network.add_peer()
    assert network.join(peer, room_id, d.server_name).room_version == room_version
    sent = d.client.send_message(alice, room_id, "hello")
    network.wait_for(lambda: sent in peer.event_counts(room_id), what=f"v{room_version} message")


def test_partial_state_room_goes_to_the_servers_named_at_join(
    own_sender: SynapseDeployment, network: PeerNetwork
) -> None:
    """A local user joins a room a peer hosts; the peer omits members and names one more
    server, so Synapse holds the room with partial state and sends to those two, not to
    a third whose user the state holds but that was not named."""
    d = own_sender
    alice = d.client.register(f"alice_{uuid.uuid4().hex[:8]}")
    host, named, unnamed = network.add_peers(3)
    room_id = network.host_room(host, [named.server_name], members=[unnamed])
    d.client.join(alice, room_id, via=[host.server_name])
    partial = f"SELECT count(*) FROM partial_state_rooms WHERE room_id = '{room_id}'"
    assert d.sql(partial).strip() == "1"
    servers = d.sql(
        f"SELECT server_name FROM partial_state_rooms_servers WHERE room_id = '{room_id}'"
    ).split()
    assert sorted(servers) == sorted([host.server_name, named.server_name])
    fence_room = d.client.create_room(alice)
    network.join(unnamed, fence_room, d.server_name)
    sent = d.client.send_message(alice, room_id, "in a partial-state room")
    # Which servers get it is the point, not how soon: Synapse's sender, just started
    # for this module, may first be retrying the session's earlier, now closed, peers
    # (a CI run at 640c889 missed the 30 s default once; alone it takes about a second).
    network.wait_for(
        lambda: all(sent in p.event_counts(room_id) for p in (host, named)),
        timeout_s=90, what="the message at both servers",
    )
    assert host.event_counts(room_id)[sent] == named.event_counts(room_id)[sent] == 1
    fence = d.client.send_message(alice, fence_room, "fence")
    network.wait_for(lambda: fence in unnamed.event_counts(fence_room), what="the fence")
    assert unnamed.event_counts(room_id) == {}
