"""The harness runs our worker as the deployment's sender (testing/our_sender.py)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from federation_sender.testing.certs import LoopbackCA
from federation_sender.testing.our_sender import OurSender
from federation_sender.testing.synapse_deployment import SynapseDeployment
from federation_sender.testing.synapse_peer import PeerNetwork


@pytest.fixture
def network(loopback_ca: LoopbackCA, tmp_path: Path) -> Iterator[PeerNetwork]:
    with PeerNetwork(loopback_ca, tmp_path / "peers") as net:
        yield net


def test_our_sender_starts_delivers_and_stops_cleanly(
    synapse_deployment: SynapseDeployment, network: PeerNetwork, tmp_path: Path
) -> None:
    d = synapse_deployment
    alice = d.client.register(f"alice_{uuid.uuid4().hex[:8]}")
    room_id = d.client.create_room(alice)
    peer = network.add_peer()
    network.join(peer, room_id, d.server_name)
    ours = OurSender(d, tmp_path / "ours")
    ours.start()
    try:
        assert ours.running
        sent = d.client.send_message(alice, room_id, "through our worker")
        network.wait_for(lambda: sent in peer.event_counts(room_id), what="delivery")
    finally:
        status = ours.stop()
    assert status == 0, ours.log_tail()
    assert peer.event_counts(room_id)[sent] == 1 and peer.rejected == []
