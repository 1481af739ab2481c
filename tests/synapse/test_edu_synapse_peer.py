"""A real Synapse as the destination: our worker sends the EDUs of a Synapse 1.163
deployment to a second Synapse 1.163 (on SQLite, sending for itself), whose user sees
them through its client API: typing, the read receipt, a to-device message, and the
sender's device-list change."""

from __future__ import annotations

import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from federation_sender.testing.certs import LoopbackCA
from federation_sender.testing.synapse_client import User
from federation_sender.testing.synapse_deployment import SynapseDeployment, create_deployment
from federation_sender.testing.waiting import wait_until_blocking
from tests.synapse import edu_support as e2ee
from tests.synapse.backend_support import OurWorker

pytestmark = pytest.mark.postgres
WAIT_S = 30.0



@pytest.fixture(scope="module")
def peer(loopback_ca: LoopbackCA, tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[SynapseDeployment]:
    deployment = create_deployment(tmp_path_factory.mktemp("synapse-peer"), ca=loopback_ca)
    deployment.start()
    yield deployment
    deployment.stop()


def q(s: str) -> str:
    return urllib.parse.quote(s, safe="")


class Syncer:
    """Bob's /sync on the destination Synapse, long-polled until a condition holds."""

    def __init__(self, d: SynapseDeployment, user: User, sender: OurWorker) -> None:
        self.d, self.user, self.sender = d, user, sender
        self.first: dict[str, Any] = d.client.sync(user)
        self.since = self.first["next_batch"]

    def until(self, found: Callable[[dict[str, Any]], bool], what: str) -> None:
        def next_sync() -> dict[str, Any]:
            body: dict[str, Any] = self.d.client.sync(self.user, self.since, 1000)
            self.since = body["next_batch"]
            return body

        # Say what our worker did, which its log (gone with the test's directory)
        # would have told.
        wait_until_blocking(next_sync, f"{what} at the destination's user", accept=found,
                            timeout_s=WAIT_S, every_s=0,  # the long poll is the wait
                            details=lambda: f"our worker's log ends:\n{self.sender.log_tail()}")


def ephemeral(body: dict[str, Any], room_id: str, event_type: str) -> list[dict[str, Any]]:
    room = body.get("rooms", {}).get("join", {}).get(room_id, {})
    return [e for e in room.get("ephemeral", {}).get("events", []) if e["type"] == event_type]


def test_a_real_synapse_sees_our_edus(
    ours: OurWorker, peer: SynapseDeployment
) -> None:
    d = ours.d
    alice = d.client.register(f"dest_alice_{uuid.uuid4().hex[:8]}")
    room_id = d.client.create_room(alice)
    bob = peer.client.register(f"bob_{uuid.uuid4().hex[:8]}")
    peer.client.join(bob, room_id, via=[d.server_name])
    bob_sync = Syncer(peer, bob, ours)
    # A remote join is a partial-state join: Synapse leaves the room out of /sync until
    # it has the room's full state, and a typing update received meanwhile is never
    # shown (it precedes the token of the sync that first shows the room). In a CI run
    # the peer cleared the partial-state flag 4 ms before our typing EDU came in ("Got
    # typing update"), and the sync that first showed the room, 40 ms later, did not
    # carry it. Alice types once bob's sync has the room.
    def joined(b: dict[str, Any]) -> bool:
        return room_id in b.get("rooms", {}).get("join", {})

    if not joined(bob_sync.first):
        bob_sync.until(joined, "the room, fully joined,")

    typing = f"/_matrix/client/v3/rooms/{q(room_id)}/typing/{q(alice.user_id)}"
    d.client.call("PUT", typing, {"typing": True, "timeout": 30000}, alice.access_token)
    bob_sync.until(lambda b: any(alice.user_id in e["content"]["user_ids"]
                                 for e in ephemeral(b, room_id, "m.typing")), "typing")

    event_id = d.client.send_message(alice, room_id, "read me")
    d.client.call("POST", f"/_matrix/client/v3/rooms/{q(room_id)}/receipt/m.read/{q(event_id)}",
                  {}, alice.access_token)
    bob_sync.until(lambda b: any(
        alice.user_id in e["content"].get(event_id, {}).get("m.read", {})
        for e in ephemeral(b, room_id, "m.receipt")), "the read receipt")

    secret = uuid.uuid4().hex
    d.client.call("PUT", f"/_matrix/client/v3/sendToDevice/m.test/{uuid.uuid4().hex}",
                  {"messages": {bob.user_id: {bob.device_id: {"secret": secret}}}},
                  alice.access_token)
    bob_sync.until(lambda b: any(e.get("content", {}).get("secret") == secret
                                 for e in b.get("to_device", {}).get("events", [])),
                   "the to-device message")

    phone = e2ee.login(d, alice, "Phone")
    e2ee.upload_device_keys(d, phone)
    bob_sync.until(lambda b: alice.user_id in b.get("device_lists", {}).get("changed", []),
                   "alice's device-list change")
    keys = peer.client.call("POST", "/_matrix/client/v3/keys/query",
                            {"device_keys": {alice.user_id: []}}, bob.access_token)
    assert phone.device_id in keys["device_keys"].get(alice.user_id, {})
