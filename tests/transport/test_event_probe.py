"""``FederationClient.event_persisted``: the signed ``GET /event`` pacing asks with, and
how a receiver's answers are read (``queue/core/pacing.py``)."""

from __future__ import annotations

import json

import pytest
from aiohttp import web

from federation_sender.testing.certs import CertFiles
from federation_sender.transport.result import EventHeld, Outcome, Transaction
from federation_sender.transport.signing import SigningKey, verify_key_lookup, verify_request

from .conftest import ORIGIN, FakeRemote, make_client


@pytest.mark.parametrize(
    ("status", "body", "held"),
    [
        (200, {"origin": "r", "origin_server_ts": 1, "pdus": [{}]}, EventHeld.YES),
        (404, "", EventHeld.NOT_YET),  # Synapse's on_pdu_request: 404, ""
        (404, {"errcode": "M_NOT_FOUND"}, EventHeld.NOT_YET),
        (404, {"errcode": "M_UNRECOGNIZED"}, EventHeld.UNSUPPORTED),
        (404, None, EventHeld.UNSUPPORTED),  # no such route: not JSON
        (500, {"errcode": "M_UNKNOWN"}, EventHeld.NO_ANSWER),
        (403, {"errcode": "M_FORBIDDEN"}, EventHeld.NO_ANSWER),
    ],
)
@pytest.mark.parametrize("http_client", ["builtin", "aiohttp"])
async def test_answers_are_read_as_synapse_gives_them(
    certs: CertFiles, our_key: SigningKey, remote: FakeRemote,
    status: int, body: object, held: EventHeld, http_client: str,
) -> None:
    seen: list[str] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        seen.append(verify_request(
            authorization=request.headers.getall("Authorization"), method=request.method,
            uri=request.raw_path, our_server_name=request.headers["Host"], content=None,
            lookup_key=verify_key_lookup({ORIGIN: {our_key.key_id: our_key.verify_key}})))
        if body is None:
            return web.Response(status=status, text="404: Not Found")
        return web.Response(status=status, text=json.dumps(body),
                            content_type="application/json")

    remote.handler = handler
    async with make_client(certs, our_key, http_client=http_client) as client:
        assert await client.event_persisted(remote.name, "$ev/1:x") is held
    request, _ = remote.requests[0]
    assert (request.method, request.raw_path) == (
        "GET", "/_matrix/federation/v1/event/%24ev%2F1%3Ax")
    assert seen == [ORIGIN]


@pytest.mark.parametrize("http_client", ["builtin", "aiohttp"])
async def test_no_connection_is_no_answer(certs: CertFiles, our_key: SigningKey,
                                          http_client: str) -> None:
    async with make_client(certs, our_key, http_client=http_client) as client:
        assert await client.event_persisted("127.0.0.1:1", "$e") is EventHeld.NO_ANSWER


async def test_the_get_rides_the_connection_send_keeps_alive(
    certs: CertFiles, our_key: SigningKey, remote: FakeRemote
) -> None:
    """Pacing asks after (nearly) every transaction in a busy room: over the built-in
    client the GET reuses /send's connection, one TLS handshake for both (aiohttp's
    pool would open a second connection per destination)."""
    async with make_client(certs, our_key) as client:
        sent = await client.send_transaction(Transaction(remote.name, "t1", ({},), ()))
        assert sent.outcome is Outcome.SUCCESS
        assert await client.event_persisted(remote.name, "$e") is EventHeld.YES
    assert [r.method for r, _ in remote.requests] == ["PUT", "GET"]
    assert len(remote.sni) == 1
