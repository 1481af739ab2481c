"""Interop with a real Synapse on loopback: signed /send, to-device, PDUs, auth.

One Synapse serves the whole module (it starts in about 2 s once installed); our key
endpoint runs on a TLS loopback listener so Synapse can verify our signatures. Our
server name is ``localhost:<port>`` and Synapse's an IP literal with a port, so
nothing leaves loopback.
"""

from __future__ import annotations

import asyncio
import json
import urllib.parse
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from federation_sender.clock import SystemClock, time_ms
from federation_sender.testing.certs import LoopbackCA
from federation_sender.testing.ports import free_port
from federation_sender.testing.synapse_client import User
from federation_sender.testing.synapse_deployment import SynapseDeployment, create_deployment
from federation_sender.transport.client import FederationClient
from federation_sender.transport.keyserver import make_key_app
from federation_sender.transport.result import Outcome, Transaction
from federation_sender.transport.signing import SigningKey

from .conftest import LOOPBACK
from .keyserver_thread import ThreadedSite
from .pdus import make_message_pdu


@dataclass
class Ours:
    server_name: str
    key: SigningKey


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> LoopbackCA:
    return LoopbackCA.create(tmp_path_factory.mktemp("ca"))


@pytest.fixture(scope="module")
def ours(tmp_path_factory: pytest.TempPathFactory, ca: LoopbackCA) -> Iterator[Ours]:
    port = free_port()
    # A hostname, not an IP literal: Synapse checks IP-literal server names against
    # its block list without consulting ip_range_whitelist, but resolved names are
    # checked with the allow list.
    name = f"localhost:{port}"
    key = SigningKey.generate("a_interop")
    certs = ca.issue(tmp_path_factory.mktemp("ours-tls"), ["localhost"])
    site = ThreadedSite(
        make_key_app(server_name=name, signing_key=key, clock=SystemClock()),
        certs.server_context(),
        port,
    )
    site.start()
    yield Ours(name, key)
    site.stop()


@pytest.fixture(scope="module")
def synapse(
    tmp_path_factory: pytest.TempPathFactory, ca: LoopbackCA
) -> Iterator[SynapseDeployment]:
    """One Synapse process on SQLite, sending federation itself (no workers)."""
    server = create_deployment(Path(tmp_path_factory.mktemp("synapse")), ca=ca)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def alice(synapse: SynapseDeployment) -> User:
    return synapse.client.register("alice", "correct horse battery")


def client_for(
    ours: Ours, synapse: SynapseDeployment, key: SigningKey | None = None
) -> FederationClient:
    return FederationClient(
        server_name=ours.server_name,
        signing_key=key or ours.key,
        clock=SystemClock(),
        attempt_timeout_s=15.0,
        tls_extra_ca_file=str(synapse.ca_cert),  # the test CA
        ip_allow_list=LOOPBACK,
    )


def to_device_edu(ours: Ours, user: User, message: dict[str, Any]) -> dict[str, Any]:
    return {
        "edu_type": "m.direct_to_device",
        "content": {
            "sender": f"@bob:{ours.server_name}",
            "type": "org.example.interop",
            "message_id": uuid.uuid4().hex,
            "messages": {user.user_id: {user.device_id: message}},
        },
    }


async def sync(synapse: SynapseDeployment, user: User, since: str | None) -> dict[str, Any]:
    query = {"timeout": "0"}
    if since:
        query["since"] = since
    path = "/_matrix/client/v3/sync?" + urllib.parse.urlencode(query)
    return await asyncio.to_thread(synapse.client.call, "GET", path, None, user.access_token)


async def to_device_events(
    synapse: SynapseDeployment, user: User, since: str | None, wait_s: float
) -> tuple[list[dict[str, Any]], str]:
    """Sync until to-device events arrive or ``wait_s`` passes."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while True:
        body = await sync(synapse, user, since)
        events = body.get("to_device", {}).get("events", [])
        if events or loop.time() >= deadline:
            return events, body["next_batch"]
        since = body["next_batch"]
        await asyncio.sleep(0.1)


async def test_to_device_edu_and_unknown_room_pdu_delivered_once(
    ours: Ours, synapse: SynapseDeployment, alice: User
) -> None:
    _, since = await to_device_events(synapse, alice, None, 0)
    marker = uuid.uuid4().hex
    _, pdu = make_message_pdu(
        ours.key,
        ours.server_name,
        room_id=f"!unknown:{ours.server_name}",
        sender=f"@bob:{ours.server_name}",
        body="hello",
        ts_ms=time_ms(SystemClock()),
    )
    txn = Transaction(
        destination=synapse.server_name,
        txn_id=f"interop-{marker}",
        pdus=[pdu],
        edus=[to_device_edu(ours, alice, {"marker": marker})],
    )
    async with client_for(ours, synapse) as client:
        result = await client.send_transaction(txn)
        assert result.outcome is Outcome.SUCCESS, (result, synapse.main.log_tail())
        assert result.pdu_errors == {}  # a valid PDU for an unknown room is dropped quietly

        events, since = await to_device_events(synapse, alice, since, 5.0)
        assert [e["content"] for e in events] == [{"marker": marker}]
        assert events[0]["sender"] == f"@bob:{ours.server_name}"

        again = await client.send_transaction(txn)  # same txn id: a retry
        assert again.outcome is Outcome.SUCCESS
        events, _ = await to_device_events(synapse, alice, since, 1.0)
        assert events == []


async def test_pdu_with_bad_signature_is_reported_per_pdu(
    ours: Ours, synapse: SynapseDeployment, alice: User
) -> None:
    room_id = await asyncio.to_thread(synapse.client.create_room, alice, room_version="10")
    forger = SigningKey.generate(ours.key.version)
    event_id, pdu = make_message_pdu(
        ours.key,
        ours.server_name,
        room_id=room_id,
        sender=f"@bob:{ours.server_name}",
        body="forged",
        ts_ms=time_ms(SystemClock()),
        sign_with=forger,
    )
    txn = Transaction(synapse.server_name, f"bad-pdu-{uuid.uuid4().hex}", [pdu], [])
    async with client_for(ours, synapse) as client:
        result = await client.send_transaction(txn)
    assert result.outcome is Outcome.SUCCESS, (result, synapse.main.log_tail())
    assert set(result.pdu_errors) == {event_id}, result
    assert client.stats.pdu_errors == 1


async def test_wrongly_signed_request_is_refused_and_classified_permanent(
    ours: Ours, synapse: SynapseDeployment, alice: User
) -> None:
    impostor = SigningKey.generate(ours.key.version)  # same key id, other secret
    txn = Transaction(
        synapse.server_name,
        f"forged-{uuid.uuid4().hex}",
        [],
        [to_device_edu(ours, alice, {"forged": True})],
    )
    async with client_for(ours, synapse, key=impostor) as client:
        result = await client.send_transaction(txn)
    assert result.outcome is Outcome.PERMANENT, (result, synapse.main.log_tail())
    assert (result.status, result.errcode) == (401, "M_UNAUTHORIZED")
    events, _ = await to_device_events(synapse, alice, None, 0)
    assert all(e["content"] != {"forged": True} for e in events)
    json.dumps(result.error)  # log-safe text
