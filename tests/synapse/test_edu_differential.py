"""The same scripted traffic once with Synapse's own federation_sender worker and once
with ours: per destination and per EDU type, the same EDUs (contents normalised only
where a run necessarily differs: event ids, the new device's id and keys, stream ids,
timestamps). Each step waits until its EDU reached every peer, so what is compared does
not depend on how a sender happened to batch two steps."""

from __future__ import annotations

import urllib.parse
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from federation_sender.testing.synapse_client import User
from federation_sender.testing.synapse_deployment import SynapseDeployment
from federation_sender.testing.synapse_peer import FederationPeer, PeerNetwork
from federation_sender.testing.waiting import wait_until_blocking
from tests.synapse import edu_support as e2ee
from tests.synapse.backend_support import OurWorker

pytestmark = pytest.mark.postgres


@dataclass
class Run:
    """What one run did, to normalise what the peers received."""

    label: str
    events: dict[str, str] = field(default_factory=dict)
    """event id -> role"""
    phone: str = ""
    phone_keys: dict[str, Any] = field(default_factory=dict)
    start: dict[str, int] = field(default_factory=dict)
    """peer -> how many transactions it had before the run"""


@dataclass
class Room:
    room_id: str
    alice: User
    peers: list[FederationPeer]



@pytest.fixture(scope="module")
def room(synapse_deployment: SynapseDeployment, network: PeerNetwork) -> Room:
    d = synapse_deployment
    alice = d.client.register(f"diff_alice_{uuid.uuid4().hex[:8]}")
    admin = d.client.register(f"diff_admin_{uuid.uuid4().hex[:8]}", admin=True)
    # The script sets presence more often than Synapse's default rate allows.
    d.client.call("POST", f"/_synapse/admin/v1/users/{q(alice.user_id)}/override_ratelimit",
                  {"messages_per_second": 0, "burst_count": 0}, admin.access_token)
    room_id = d.client.create_room(alice)
    peers = network.add_peers(2)
    for p in peers:
        network.join(p, room_id, d.server_name)
    return Room(room_id, alice, peers)


def q(s: str) -> str:
    return urllib.parse.quote(s, safe="")


def received(room: Room, run: Run, peer: FederationPeer) -> list[dict[str, Any]]:
    return [e for t in peer.transactions[run.start[peer.server_name]:] for e in t.edus]


def script(d: SynapseDeployment, net: PeerNetwork, room: Room, run: Run) -> None:
    alice = room.alice

    def step(action: Callable[[], None], edu_type: str, match: Callable[[Any], bool],
             what: str) -> None:
        action()
        net.wait_for(lambda: all(any(e["edu_type"] == edu_type and match(e["content"])
                                     for e in received(room, run, p)) for p in room.peers),
                     what=f"{what} ({run.label})")

    typing = f"/_matrix/client/v3/rooms/{q(room.room_id)}/typing/{q(alice.user_id)}"
    presence = f"/_matrix/client/v3/presence/{q(alice.user_id)}/status"
    for on in (True, False):
        step(lambda on=on: d.client.call("PUT", typing, {"typing": on, "timeout": 30000},
                                         alice.access_token),
             "m.typing", lambda c, on=on: c["typing"] is on, f"typing {on}")

    read, private = (d.client.send_message(alice, room.room_id, f"{run.label} {i}")
                     for i in range(2))
    run.events.update({read: "read", private: "private"})
    base = f"/_matrix/client/v3/rooms/{q(room.room_id)}/receipt"
    d.client.call("POST", f"{base}/m.read.private/{q(private)}", {}, alice.access_token)
    step(lambda: d.client.call("POST", f"{base}/m.read/{q(read)}", {}, alice.access_token),
         "m.receipt", lambda c: room.room_id in c, "the receipt")

    peer = room.peers[0]
    body = {"messages": {peer.user_id(): {"DEV": {"run": run.label}}}}
    d.client.call("PUT", f"/_matrix/client/v3/sendToDevice/m.test/{uuid.uuid4().hex}", body,
                  alice.access_token)
    net.wait_for(lambda: any(e["edu_type"] == "m.direct_to_device"
                             for e in received(room, run, peer)), what="to-device")

    step(lambda: d.client.call("PUT", presence,
                               {"presence": "unavailable", "status_msg": run.label},
                               alice.access_token),
         "m.presence", lambda c: any(s.get("status_msg") == run.label for s in c["push"]),
         "presence")

    phone = e2ee.login(d, alice, "Phone")
    run.phone = phone.device_id
    step(lambda: None, "m.device_list_update", lambda c: c["device_id"] == phone.device_id,
         "the new device")
    run.phone_keys, _ = e2ee.upload_device_keys(d, phone)
    step(lambda: None, "m.device_list_update", lambda c: c.get("keys") == run.phone_keys,
         "the new device's keys")
    cs = e2ee.upload_cross_signing(d, alice)
    for edu_type in ("m.signing_key_update", "org.matrix.signing_key_update"):
        step(lambda: None, edu_type, lambda c: f"ed25519:{cs.master_pub}" in c.get(
            "master_key", {}).get("keys", {}), "the cross-signing keys")


def begin(d: SynapseDeployment, net: PeerNetwork, room: Room, run: Run) -> None:
    """A presence change both runs make from a different state, delivered before the
    compared part starts: presence then starts from the same state in both runs."""
    alice = room.alice
    marker = f"start {run.label}"
    d.client.call("PUT", f"/_matrix/client/v3/presence/{q(alice.user_id)}/status",
                  {"presence": "online", "status_msg": marker}, alice.access_token)
    net.wait_for(lambda: all(any(e["edu_type"] == "m.presence"
                                 and any(s.get("status_msg") == marker for s in e["content"][
                                     "push"]) for t in p.transactions for e in t.edus)
                             for p in room.peers), what=f"the start marker ({run.label})")
    run.start = {p.server_name: len(p.transactions) for p in room.peers}


def outbox_rows(d: SynapseDeployment, room: Room) -> str:
    """Rows left in Synapse's device-list and to-device outboxes for the room's peers."""
    names = ", ".join(f"'{p.server_name}'" for p in room.peers)
    return d.sql(
        f"SELECT (SELECT count(*) FROM device_lists_outbound_pokes WHERE destination IN ({names}))"
        f" + (SELECT count(*) FROM device_federation_outbox WHERE destination IN ({names}))"
    ).strip()


def normalise(run: Run, room: Room, edu: dict[str, Any], prev: dict[str, int]) -> Any:
    t, c = edu["edu_type"], edu["content"]
    alice = room.alice.user_id
    if t == "m.receipt":
        return t, {r: {rt: {u: ([run.events.get(e, e) for e in v["event_ids"]],
                                {k: x for k, x in v["data"].items() if k != "ts"})
                            for u, v in users.items()} for rt, users in types.items()}
                   for r, types in c.items()}
    if t == "m.presence":
        return t, [{k: ("LABEL" if v == run.label else v) for k, v in s.items()
                    if k != "last_active_ago"} for s in c["push"]]
    if t == "m.direct_to_device":
        return t, {k: v for k, v in c.items() if k != "message_id"} | {"messages": {
            u: {dev: {"run": "LABEL"} for dev in devs} for u, devs in c["messages"].items()}}
    if t == "m.device_list_update":
        chained = c["prev_id"] == ([prev[c["user_id"]]] if c["user_id"] in prev else [])
        prev[c["user_id"]] = c["stream_id"]
        out = {k: v for k, v in c.items() if k not in ("stream_id", "prev_id", "keys")}
        out["device_id"] = "PHONE" if c["device_id"] == run.phone else c["device_id"]
        out["keys"] = ("PHONE_KEYS" if c.get("keys") == run.phone_keys
                       else "KEYS" if "keys" in c else None)
        return t, out | {"prev_id_chained": chained, "mine": c["user_id"] == alice}
    if t in ("m.signing_key_update", "org.matrix.signing_key_update"):
        return t, {k: ({kk: ("KEY" if kk in ("keys", "signatures") else vv)
                        for kk, vv in v.items()} if isinstance(v, dict) else v)
                   for k, v in c.items()}
    return t, c


SIGNING_KEY_TYPES = ("m.signing_key_update", "org.matrix.signing_key_update")


def merge_signing_key_updates(edus: list[Any]) -> list[Any]:
    """One signing-key update per type and user, at its first place: the keys of one
    upload reach the outbox as one poke per key, and whether a sender reads them in one
    window or two is timing (both senders split them on a busy machine); a receiver
    merges the updates either way, so the merged keys are what must agree."""
    out: list[Any] = []
    merged: dict[tuple[str, str], dict[str, Any]] = {}
    for t, c in edus:
        if t not in SIGNING_KEY_TYPES:
            out.append((t, c))
            continue
        key = (t, c["user_id"])
        if key in merged:
            merged[key].update(c)
        else:
            merged[key] = dict(c)
            out.append((t, merged[key]))
    return out


def capture(room: Room, run: Run) -> list[list[Any]]:
    out = []
    for peer in room.peers:
        prev: dict[str, int] = {}
        out.append(merge_signing_key_updates(
            [normalise(run, room, e, prev) for e in received(room, run, peer)]))
    return out


def test_same_edus_as_synapses_own_worker(
    synapse_deployment: SynapseDeployment, network: PeerNetwork, room: Room,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    d = synapse_deployment
    runs = {"synapse": Run("synapse-run"), "ours": Run("our-run")}
    results = {}
    ours = OurWorker(d, tmp_path_factory.mktemp("ours-diff"))
    for name, run in runs.items():
        if name == "synapse":
            d.start_federation_sender()
        else:
            ours.start()
        try:
            begin(d, network, room, run)
            script(d, network, room, run)
            # Stop only once the sender recorded its deliveries (else the next one sends
            # them again, rightly: at least once).
            wait_until_blocking(lambda: outbox_rows(d, room), "the outboxes drained",
                                accept=lambda left: left == "0", timeout_s=20)
        finally:
            d.stop_federation_sender() if name == "synapse" else ours.stop()
        results[name] = capture(room, run)
    assert results["ours"] == results["synapse"]
    # The private receipt went nowhere in either run.
    for per_peer in results.values():
        for edus in per_peer:
            assert all("m.read.private" not in str(c) for t, c in edus if t == "m.receipt")
