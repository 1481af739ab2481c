"""EDUs on the wire: what Synapse's own federation_sender worker sends to servers that
joined a room over federation, against what this project builds from the same
database. Peers are fake homeservers (:mod:`federation_sender.testing.synapse_peer`)
that verify every request's signature."""

from __future__ import annotations

import itertools
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from federation_sender.storage.synapse import device_lists as dl
from federation_sender.storage.synapse.database import create_synapse_engine
from federation_sender.testing.synapse_client import User
from federation_sender.testing.synapse_deployment import SynapseDeployment
from federation_sender.testing.synapse_peer import FederationPeer, PeerNetwork
from federation_sender.testing.waiting import wait_until, wait_until_blocking
from tests.synapse import edu_support as e2ee

DEVICE_EDUS = (dl.DEVICE_LIST_UPDATE, dl.SIGNING_KEY_UPDATE, dl.UNSTABLE_SIGNING_KEY_UPDATE)
_txn = itertools.count()


@dataclass
class Room:
    room_id: str
    alice: User
    peers: list[FederationPeer]



@pytest.fixture(scope="module")
def room(synapse_deployment: SynapseDeployment, network: PeerNetwork) -> Room:
    d = synapse_deployment
    alice = d.client.register(f"wire_alice_{uuid.uuid4().hex[:8]}")
    room_id = d.client.create_room(alice)
    peers = network.add_peers(2)
    for p in peers:
        network.join(p, room_id, d.server_name)
    return Room(room_id, alice, peers)


@pytest.fixture
async def engine(synapse_deployment: SynapseDeployment) -> AsyncIterator[AsyncEngine]:
    eng = create_synapse_engine(synapse_deployment.database_url, pool_size=2)
    yield eng
    await eng.dispose()


def of_user(edus: list[dict[str, Any]], user_id: str) -> list[str]:
    return sorted(
        json.dumps([e["edu_type"], e["content"]], sort_keys=True)
        for e in edus
        if e["edu_type"] in DEVICE_EDUS and e["content"].get("user_id") == user_id
    )


async def converted(engine: AsyncEngine, user_id: str) -> bool:
    async with engine.connect() as conn:
        q = text("SELECT (SELECT max(stream_id) FROM device_lists_changes_in_room"
                 "         WHERE user_id = :u)"
                 "  <= (SELECT stream_id FROM device_lists_changes_converted_stream_position)")
        return bool((await conn.execute(q, {"u": user_id})).scalar())


async def test_device_list_edus_match_synapses_worker_on_the_wire(
    synapse_deployment: SynapseDeployment, network: PeerNetwork, room: Room, engine: AsyncEngine
) -> None:
    d = synapse_deployment
    alice = room.alice
    phone = e2ee.login(d, alice, "Phone")
    keys, _ = e2ee.upload_device_keys(d, alice)
    e2ee.upload_device_keys(d, phone)
    cs = e2ee.upload_cross_signing(d, alice)
    e2ee.sign_device(d, alice, keys, cs)
    e2ee.delete_device(d, alice, phone.device_id)
    # Main turns device changes into pokes in the background, with stream ids of their
    # own: wait until every change is converted, then read up to the newest poke.
    await wait_until(lambda: converted(engine, alice.user_id),
                     "main to convert every device change into pokes", timeout_s=30,
                     every_s=0.05)
    now = int(d.sql("SELECT max(stream_id) FROM device_lists_outbound_pokes").strip())

    ours: dict[str, list[str]] = {}
    async with engine.connect() as conn:
        for p in room.peers:
            rows = await dl.device_list_rows(conn, p.server_name, -1, now, 100,
                                             allow_device_names=False)
            ours[p.server_name] = sorted(
                json.dumps([r.edu_type, json.loads(r.content_json)], sort_keys=True)
                for r in rows)
    assert all(len(v) >= 4 for v in ours.values())

    d.start_federation_sender()
    try:
        d.client.send_message(alice, room.room_id, "wake up")  # a transaction for each peer
        network.wait_for(
            lambda: all(len(of_user(p.edus(), alice.user_id)) >= len(ours[p.server_name])
                        for p in room.peers), what="device-list EDUs from Synapse's worker")
    finally:
        d.stop_federation_sender()
    for p in room.peers:
        assert of_user(p.edus(), alice.user_id) == ours[p.server_name]


async def test_to_device_content_is_the_outbox_row(
    synapse_deployment: SynapseDeployment, network: PeerNetwork, room: Room, engine: AsyncEngine
) -> None:
    d = synapse_deployment
    peer = room.peers[0]
    target = peer.user_id()
    path = f"/_matrix/client/v3/sendToDevice/m.test/{uuid.uuid4().hex}"
    d.client.call("PUT", path, {"messages": {target: {"DEV": {"n": next(_txn)}}}},
                  room.alice.access_token)
    async with engine.connect() as conn:
        stored = [json.loads(r[0]) for r in await conn.execute(text(
            "SELECT messages_json FROM device_federation_outbox WHERE destination = :d"
            " ORDER BY stream_id"), {"d": peer.server_name})]
    assert stored and stored[-1]["messages"] == {target: {"DEV": {"n": stored[-1][
        "messages"][target]["DEV"]["n"]}}}
    d.start_federation_sender()
    try:
        network.wait_for(lambda: any(e["content"] == stored[-1]
                                     for e in peer.edus("m.direct_to_device")),
                         what="the to-device EDU from Synapse's worker")
        # Synapse deletes what was delivered, after it has read the 200: the peer can
        # record the EDU before the worker's delete commits, so wait for the delete.
        wait_until_blocking(
            lambda: d.sql("SELECT count(*) FROM device_federation_outbox WHERE destination = "
                          f"'{peer.server_name}'").strip(),
            "Synapse's worker to delete the delivered to-device row",
            accept=lambda left: left == "0", timeout_s=20)
    finally:
        d.stop_federation_sender()
