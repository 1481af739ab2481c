"""The fake remote homeservers among themselves: signed requests, verification, records."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest

from federation_sender.testing.certs import LoopbackCA
from federation_sender.testing.signed_events import event_id, hash_and_sign
from federation_sender.testing.synapse_peer import PeerNetwork, PeerRequestError
from federation_sender.transport.signing import SigningKey


@pytest.fixture
def network(loopback_ca: LoopbackCA, tmp_path: Path) -> Iterator[PeerNetwork]:
    with PeerNetwork(loopback_ca, tmp_path) as net:
        yield net


def test_transaction_is_verified_recorded_once_and_retries_counted(network: PeerNetwork) -> None:
    a, b = network.add_peers(2)
    key = SigningKey.generate()
    _, pdu = hash_and_sign(
        {"type": "m.room.message", "room_id": "!r:x", "sender": "@u:x", "content": {"body": "hi"},
         "depth": 3, "prev_events": [], "auth_events": [], "origin_server_ts": 1},
        key, a.server_name, "12",
    )  # fmt: skip
    edu = {"edu_type": "m.typing", "content": {}}
    answer = network.send_transaction(a, b.server_name, [pdu], [edu], txn_id="t1")
    network.send_transaction(a, b.server_name, [pdu], [edu], txn_id="t1")  # a retry
    network.wait_for(lambda: b.retried_transactions == 1)
    assert [(t.origin, t.txn_id) for t in b.transactions] == [(a.server_name, "t1")]
    assert b.event_counts() == {event_id(pdu, "12"): 1}
    assert answer == {"pdus": {event_id(pdu, "12"): {}}}
    assert b.edus("m.typing") == [edu] and b.edus("m.receipt") == []


def test_forged_signature_is_refused_and_not_recorded(network: PeerNetwork) -> None:
    a, b = network.add_peers(2)
    impostor = dataclasses.replace(a, key=SigningKey.generate(a.key.version))
    with pytest.raises(PeerRequestError, match="401"):
        network.send_transaction(impostor, b.server_name)
    assert b.transactions == [] and len(b.rejected) == 1


def test_refusing_peer_answers_its_status(network: PeerNetwork) -> None:
    a, b = network.add_peers(2)
    b.send_status = 503
    with pytest.raises(PeerRequestError, match="503"):
        network.send_transaction(a, b.server_name)
    assert b.refused_transactions == 1 and b.transactions == []
