"""Every EDU end to end: our worker as the federation sender of a real Synapse 1.163,
two fake servers that joined a room over federation (they verify every signature).
Typing, receipts (the private one never leaves), to-device (deleted after the 200),
device lists and cross-signing (pokes deleted, last success recorded), presence."""

from __future__ import annotations

import urllib.parse
import uuid
from dataclasses import dataclass
from typing import Any

import pytest

from federation_sender.testing.synapse_client import User
from federation_sender.testing.synapse_peer import FederationPeer, PeerNetwork
from federation_sender.testing.waiting import wait_until_blocking
from tests.synapse import edu_support as e2ee
from tests.synapse.backend_support import OurWorker

pytestmark = pytest.mark.postgres


@dataclass
class Room:
    room_id: str
    alice: User
    peers: list[FederationPeer]




@pytest.fixture(scope="module")
def room(ours: OurWorker, network: PeerNetwork) -> Room:
    d = ours.d
    alice = d.client.register(f"e2e_alice_{uuid.uuid4().hex[:8]}")
    room_id = d.client.create_room(alice)
    peers = network.add_peers(2)
    for p in peers:
        network.join(p, room_id, d.server_name)
    return Room(room_id, alice, peers)


def q(s: str) -> str:
    return urllib.parse.quote(s, safe="")


def everywhere(net: PeerNetwork, room: Room, edu_type: str, match: Any, what: str) -> None:
    net.wait_for(lambda: all(any(match(e["content"]) for e in p.edus(edu_type))
                             for p in room.peers), what=what)


def test_typing_reaches_every_server(ours: OurWorker, network: PeerNetwork, room: Room) -> None:
    d, alice = ours.d, room.alice
    path = f"/_matrix/client/v3/rooms/{q(room.room_id)}/typing/{q(alice.user_id)}"
    d.client.call("PUT", path, {"typing": True, "timeout": 30000}, alice.access_token)
    want = {"room_id": room.room_id, "user_id": alice.user_id, "typing": True}
    everywhere(network, room, "m.typing", lambda c: c == want, "typing: true")
    d.client.call("PUT", path, {"typing": False}, alice.access_token)
    everywhere(network, room, "m.typing", lambda c: c == {**want, "typing": False},
               "typing: false")


def test_receipts_but_never_the_private_one(
    ours: OurWorker, network: PeerNetwork, room: Room
) -> None:
    d, alice = ours.d, room.alice
    first, second = (d.client.send_message(alice, room.room_id, f"r{i}") for i in range(2))
    base = f"/_matrix/client/v3/rooms/{q(room.room_id)}/receipt"
    d.client.call("POST", f"{base}/m.read.private/{q(second)}", {}, alice.access_token)
    d.client.call("POST", f"{base}/m.read/{q(first)}", {}, alice.access_token)

    def public(c: dict[str, Any]) -> bool:
        got = c.get(room.room_id, {}).get("m.read", {}).get(alice.user_id, {})
        return bool(got.get("event_ids") == [first])

    everywhere(network, room, "m.receipt", public, "the public receipt")
    for p in room.peers:  # the private one was queued first: it would have arrived
        assert not any("m.read.private" in json_types(e["content"]) for e in p.edus("m.receipt"))


def json_types(content: dict[str, Any]) -> set[str]:
    return {t for per_room in content.values() for t in per_room}


def test_to_device_is_delivered_then_deleted(
    ours: OurWorker, network: PeerNetwork, room: Room
) -> None:
    d, peer = ours.d, room.peers[0]
    body = {"messages": {peer.user_id(): {"DEV": {"hello": uuid.uuid4().hex}}}}
    d.client.call("PUT", f"/_matrix/client/v3/sendToDevice/m.test/{uuid.uuid4().hex}", body,
                  room.alice.access_token)
    network.wait_for(lambda: any(e["content"]["messages"] == body["messages"]
                                 for e in peer.edus("m.direct_to_device")), what="to-device")
    wait_until_blocking(lambda: d.sql("SELECT count(*) FROM device_federation_outbox WHERE "
                                      f"destination = '{peer.server_name}'").strip(),
                        "the outbox row deleted", accept=lambda left: left == "0",
                        timeout_s=20)


def test_device_lists_and_cross_signing(
    ours: OurWorker, network: PeerNetwork, room: Room
) -> None:
    d, alice = ours.d, room.alice
    phone = e2ee.login(d, alice, "Phone")
    phone_keys, _ = e2ee.upload_device_keys(d, phone)
    cs = e2ee.upload_cross_signing(d, alice)

    def phone_update(c: dict[str, Any]) -> bool:
        return c.get("device_id") == phone.device_id and c.get("keys") == phone_keys

    everywhere(network, room, "m.device_list_update", phone_update, "the phone's keys")
    for edu_type in ("m.signing_key_update", "org.matrix.signing_key_update"):
        everywhere(network, room, edu_type,
                   lambda c: c.get("master_key", {}).get("keys") == {
                       f"ed25519:{cs.master_pub}": cs.master_pub}, edu_type)
    for p in room.peers:
        updates = [e["content"] for e in p.edus("m.device_list_update")
                   if e["content"]["user_id"] == alice.user_id]
        ids = [u["stream_id"] for u in updates]
        assert ids == sorted(ids) and all(u["prev_id"] in ([], [prev]) for u, prev in
                                          zip(updates[1:], ids, strict=False))
        assert "device_display_name" not in updates[-1]

    def pokes_left() -> str:
        return d.sql("SELECT count(*) FROM device_lists_outbound_pokes WHERE user_id = "
                     f"'{alice.user_id}'").strip()

    wait_until_blocking(pokes_left, "the pokes deleted", accept=lambda left: left == "0",
                        timeout_s=20)
    last = d.sql("SELECT destination FROM device_lists_outbound_last_success WHERE user_id = "
                 f"'{alice.user_id}' ORDER BY destination").split()
    assert last == sorted(p.server_name for p in room.peers)


def test_presence(ours: OurWorker, network: PeerNetwork, room: Room) -> None:
    d, alice = ours.d, room.alice
    status = uuid.uuid4().hex[:8]
    d.client.call("PUT", f"/_matrix/client/v3/presence/{q(alice.user_id)}/status",
                  {"presence": "unavailable", "status_msg": status}, alice.access_token)
    everywhere(network, room, "m.presence",
               lambda c: any(s.get("user_id") == alice.user_id and s.get("status_msg") == status
                             and s.get("presence") == "unavailable" for s in c["push"]),
               "alice's presence")


def test_a_receipt_made_while_we_were_down_is_read_back(
    ours: OurWorker, network: PeerNetwork, room: Room
) -> None:
    """Main published it while no sender listened; at reconnect its POSITION shows the
    gap and the receipts fetcher reads it from receipts_linearized."""
    d, alice = ours.d, room.alice
    event_id = d.client.send_message(alice, room.room_id, "read while down")
    ours.stop()
    try:
        path = f"/_matrix/client/v3/rooms/{q(room.room_id)}/receipt/m.read/{q(event_id)}"
        d.client.call("POST", path, {}, alice.access_token)
    finally:
        ours.start()

    def it(c: dict[str, Any]) -> bool:
        got = c.get(room.room_id, {}).get("m.read", {}).get(alice.user_id, {})
        return bool(got.get("event_ids") == [event_id])

    everywhere(network, room, "m.receipt", it, "the receipt made while we were down")
