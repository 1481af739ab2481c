"""The /send client against loopback TLS servers, friendly and hostile."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from aiohttp import web

from federation_sender.testing.certs import CertFiles
from federation_sender.transport.result import Outcome, Transaction
from federation_sender.transport.signing import SigningKey, verify_key_lookup, verify_request

from .conftest import ORIGIN, FakeRemote, RawRemote, make_client


def txn(destination: str, txn_id: str = "t1", pdus: int = 0, edus: int = 1) -> Transaction:
    return Transaction(
        destination=destination,
        txn_id=txn_id,
        pdus=[{"event_id": f"$e{i}", "type": "m.test"} for i in range(pdus)],
        edus=[{"edu_type": "m.test", "content": {"n": i}} for i in range(edus)],
    )


async def test_signed_put_is_verifiable_and_pdu_errors_are_reported(
    certs: CertFiles, our_key: SigningKey, remote: FakeRemote
) -> None:
    verified: list[str] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())
        verified.append(
            verify_request(
                authorization=request.headers.getall("Authorization"),
                method=request.method,
                uri=request.raw_path,
                our_server_name=request.headers["Host"],
                content=body,
                lookup_key=verify_key_lookup({ORIGIN: {our_key.key_id: our_key.verify_key}}),
            )
        )
        return web.json_response({"pdus": {"$e0": {}, "$e1": {"error": "bad\nsignature"}}})

    remote.handler = handler
    async with make_client(certs, our_key) as client:
        result = await client.send_transaction(txn(remote.name, "a/b c?", pdus=2))
    assert result.outcome is Outcome.SUCCESS, result
    assert result.status == 200
    assert result.pdu_errors == {"$e1": "bad?signature"}
    assert result.request_bytes > 0 and result.duration_s > 0
    assert client.stats.pdu_errors == 1 and client.stats.outcomes["success"] == 1
    assert verified == [ORIGIN]
    request, raw = remote.requests[0]
    assert request.method == "PUT"
    assert request.raw_path == "/_matrix/federation/v1/send/a%2Fb%20c%3F"
    assert request.headers["Host"] == remote.name
    assert request.headers["Content-Type"] == "application/json"
    body = json.loads(raw)
    assert set(body) == {"origin", "origin_server_ts", "pdus", "edus"}
    assert body["origin"] == ORIGIN and len(body["pdus"]) == 2 and len(body["edus"]) == 1
    assert remote.sni == [None]  # no SNI for an IP literal


@pytest.mark.parametrize(
    ("status", "body", "headers", "outcome", "errcode"),
    [
        (500, {"errcode": "M_UNKNOWN"}, {}, Outcome.TRANSIENT, "M_UNKNOWN"),
        (502, None, {}, Outcome.TRANSIENT, None),
        (
            429,
            {"errcode": "M_LIMIT_EXCEEDED", "retry_after_ms": 1500},
            {},
            Outcome.TRANSIENT,
            "M_LIMIT_EXCEEDED",
        ),
        (
            401,
            {"errcode": "M_UNAUTHORIZED", "error": "Invalid signature"},
            {},
            Outcome.PERMANENT,
            "M_UNAUTHORIZED",
        ),
        (403, {"errcode": "M_FORBIDDEN"}, {}, Outcome.PERMANENT, "M_FORBIDDEN"),
        (410, None, {}, Outcome.PERMANENT, None),
        (400, {"errcode": "M_BAD_JSON"}, {}, Outcome.PERMANENT, "M_BAD_JSON"),
        (413, {"errcode": "M_TOO_LARGE"}, {}, Outcome.TOO_LARGE, "M_TOO_LARGE"),
        (302, None, {"Location": "https://127.0.0.1:1/elsewhere"}, Outcome.TRANSIENT, None),
    ],
)
async def test_status_classification_end_to_end(
    certs: CertFiles,
    our_key: SigningKey,
    remote: FakeRemote,
    status: int,
    body: dict[str, Any] | None,
    headers: dict[str, str],
    outcome: Outcome,
    errcode: str | None,
) -> None:
    async def handler(_request: web.Request) -> web.StreamResponse:
        if body is None:
            return web.Response(status=status, text="nope", headers=headers)
        return web.json_response(body, status=status, headers=headers)

    remote.handler = handler
    async with make_client(certs, our_key) as client:
        result = await client.send_transaction(txn(remote.name))
    assert (result.outcome, result.status, result.errcode) == (outcome, status, errcode)
    if status == 429:
        assert result.retry_after_s == 1.5
    assert len(remote.requests) == 1  # a redirect is never followed


async def test_oversized_transaction_is_refused_locally(
    certs: CertFiles, our_key: SigningKey, remote: FakeRemote
) -> None:
    async with make_client(certs, our_key) as client:
        assert (await client.send_transaction(txn(remote.name, pdus=51))).outcome is (
            Outcome.TOO_LARGE
        )
        assert (await client.send_transaction(txn(remote.name, edus=101))).outcome is (
            Outcome.TOO_LARGE
        )
        ok = await client.send_transaction(txn(remote.name, pdus=50, edus=100))
    assert ok.outcome is Outcome.SUCCESS
    assert len(remote.requests) == 1


async def _read_request(reader: asyncio.StreamReader) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    await reader.readexactly(length)


def _head(status: str, content_type: str = "application/json", extra: str = "") -> bytes:
    return f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n{extra}".encode()


async def _huge_declared(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    await _read_request(r)
    w.write(_head("200 OK", extra="Content-Length: 100000000\r\n\r\n") + b"{" * 1000)
    await w.drain()
    await asyncio.sleep(10)  # the scenario: a peer that holds the rest back


async def _huge_chunked(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    await _read_request(r)
    w.write(_head("200 OK", extra="Transfer-Encoding: chunked\r\n\r\n"))
    chunk = b" " * 65536
    for _ in range(100):  # 6.5 MB, more than the limit, less than forever
        w.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        await w.drain()


async def _invalid_json(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    await _read_request(r)
    w.write(_head("200 OK", extra="Content-Length: 5\r\n\r\n") + b"{nope")
    await w.drain()


async def _wrong_type(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    await _read_request(r)
    w.write(_head("200 OK", "text/html", "Content-Length: 2\r\n\r\n") + b"{}")
    await w.drain()


async def _json_array(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    await _read_request(r)
    w.write(_head("200 OK", extra="Content-Length: 2\r\n\r\n") + b"[]")
    await w.drain()


async def _slow_drip(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    await _read_request(r)
    w.write(_head("200 OK", extra="Content-Length: 1000\r\n\r\n"))
    for _ in range(1000):
        w.write(b" ")
        await w.drain()
        await asyncio.sleep(0.05)  # the scenario: a peer that drips its body


async def _reset_mid_body(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    await _read_request(r)
    w.write(_head("200 OK", extra="Content-Length: 1000\r\n\r\n") + b'{"pdus": {')
    await w.drain()
    w.transport.abort()


async def _garbage(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    await _read_request(r)
    w.write(b"\x00\xffthis is not HTTP\r\n\r\n")
    await w.drain()


async def _silent(r: asyncio.StreamReader, _w: asyncio.StreamWriter) -> None:
    await _read_request(r)
    await asyncio.sleep(30)  # the scenario: a peer that never answers


async def _close_immediately(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    w.transport.abort()


@pytest.mark.parametrize(
    ("handler", "expect"),
    [
        (_huge_declared, "exceeds"),
        (_huge_chunked, "exceeds"),
        (_invalid_json, "not a JSON object"),
        (_json_array, "not a JSON object"),
        (_wrong_type, "not application/json"),
        (_slow_drip, "no response within"),
        (_reset_mid_body, ""),
        (_garbage, ""),
        (_silent, "no response within"),
        (_close_immediately, ""),
    ],
)
@pytest.mark.parametrize("http_client", ["builtin", "aiohttp"])
async def test_hostile_responses_are_classified_never_raised_or_hung(
    certs: CertFiles, our_key: SigningKey, raw_remote: RawRemote, handler: Any, expect: str,
    http_client: str,
) -> None:
    raw_remote.handler = handler
    started = time.monotonic()
    async with make_client(
        certs, our_key, attempt_timeout_s=1.0, max_response_bytes=64 * 1024,
        http_client=http_client,
    ) as client:
        result = await client.send_transaction(txn(raw_remote.name))
    assert time.monotonic() - started < 3.0
    assert result.outcome is Outcome.TRANSIENT, result
    assert expect in result.error
    assert result.duration_s <= 1.5


async def test_tls_is_verified_by_default_and_can_trust_an_extra_ca(
    certs: CertFiles, our_key: SigningKey, remote: FakeRemote
) -> None:
    async with make_client(certs, our_key, tls_extra_ca_file=None) as client:
        result = await client.send_transaction(txn(remote.name))
    assert result.outcome is Outcome.TRANSIENT and "TLS" in result.error, result
    assert remote.requests == []
    async with make_client(certs, our_key, tls_extra_ca_file=None, tls_verify=False) as client:
        assert (await client.send_transaction(txn(remote.name))).outcome is Outcome.SUCCESS


async def test_tls_name_mismatch_is_refused(
    certs: CertFiles, our_key: SigningKey, remote: FakeRemote
) -> None:
    overrides = {"other.test": f"127.0.0.1:{remote.port}"}
    async with make_client(certs, our_key, destination_overrides=overrides) as client:
        ok = await client.send_transaction(txn("other.test"))
    # The override's TLS name is its host (127.0.0.1, in the certificate): accepted,
    # with the destination as Host header.
    assert ok.outcome is Outcome.SUCCESS
    assert remote.requests[0][0].headers["Host"] == "other.test"


async def test_forget_destination_lets_go_of_its_cached_state(
    certs: CertFiles, our_key: SigningKey, remote: FakeRemote
) -> None:
    """What a dropped idle queue's destination had cached (its resolved override, the
    header prefix) goes; a later transaction rebuilds it."""
    overrides = {"other.test": f"127.0.0.1:{remote.port}", "kept.test": f"127.0.0.1:{remote.port}"}
    async with make_client(certs, our_key, destination_overrides=overrides) as client:
        for d in overrides:
            assert (await client.send_transaction(txn(d))).outcome is Outcome.SUCCESS
        assert client.holds("other.test") and client.holds("kept.test")
        client.forget_destination("other.test")
        assert not client.holds("other.test") and client.holds("kept.test")
        assert (await client.send_transaction(txn("other.test"))).outcome is Outcome.SUCCESS
        assert client.holds("other.test")
    assert [r[0].headers["Host"] for r in remote.requests] == [
        "other.test", "kept.test", "other.test"]


async def test_loopback_is_refused_without_an_allow_list(
    certs: CertFiles, our_key: SigningKey, remote: FakeRemote
) -> None:
    async with make_client(certs, our_key, ip_allow_list=()) as client:
        for destination in (remote.name, f"[::ffff:127.0.0.1]:{remote.port}"):
            result = await client.send_transaction(txn(destination))
            assert result.outcome is Outcome.TRANSIENT
            assert "refused by the outbound policy" in result.error
        overridden = {"x.test": f"localhost:{remote.port}"}
    async with make_client(
        certs, our_key, ip_allow_list=(), destination_overrides=overridden
    ) as client:
        result = await client.send_transaction(txn("x.test"))
        assert "refused by the outbound policy" in result.error, result
    assert remote.requests == []


async def test_connection_pool_is_bounded_per_host(
    certs: CertFiles, our_key: SigningKey, remote: FakeRemote
) -> None:
    active = 0
    peak = 0

    async def handler(_request: web.Request) -> web.StreamResponse:
        nonlocal active, peak
        active += 1
        peak = max(peak, active)
        await asyncio.sleep(0.1)  # the scenario: slow answers, so that requests overlap
        active -= 1
        return web.json_response({})

    remote.handler = handler
    async with make_client(certs, our_key, max_connections_per_host=2) as client:
        results = await asyncio.gather(
            *(client.send_transaction(txn(remote.name, f"t{i}")) for i in range(6))
        )
    assert all(r.outcome is Outcome.SUCCESS for r in results)
    assert peak == 2


async def test_unresolvable_and_invalid_destinations(
    certs: CertFiles, our_key: SigningKey, dns_server: Any
) -> None:
    async with make_client(
        certs, our_key, nameservers=[("127.0.0.1", dns_server.port)], well_known_port=1
    ) as client:
        missing = await client.send_transaction(txn("missing.test"))
        invalid = await client.send_transaction(txn("bad name!"))
    assert missing.outcome is Outcome.TRANSIENT
    assert invalid.outcome is Outcome.PERMANENT


async def test_a_retry_reuses_the_body_and_signature_of_the_same_transaction(
    certs: CertFiles, our_key: SigningKey, remote: FakeRemote
) -> None:
    answers = [500, 200]

    async def handler(request: web.Request) -> web.StreamResponse:
        verify_request(
            authorization=request.headers.getall("Authorization"),
            method=request.method,
            uri=request.raw_path,
            our_server_name=request.headers["Host"],
            content=json.loads(await request.read()),
            lookup_key=verify_key_lookup({ORIGIN: {our_key.key_id: our_key.verify_key}}),
        )
        return web.json_response({"pdus": {}}, status=answers.pop(0))

    remote.handler = handler
    pdus = [{"event_id": f"$e{i}", "type": "m.test", "content": {"n": i}} for i in range(3)]

    def attempt(txn_id: str) -> Transaction:
        # As the queue retries: a new Transaction, the same PDU objects, equal EDUs.
        return Transaction(remote.name, txn_id, list(pdus), [{"edu_type": "m.x", "content": {}}])

    async with make_client(certs, our_key) as client:
        first = await client.send_transaction(attempt("t1"))
        retry = await client.send_transaction(attempt("t1"))
        assert (first.outcome, retry.outcome) == (Outcome.TRANSIENT, Outcome.SUCCESS)
        assert (client.requests.encodes, client.requests.signatures) == (1, 1)
        assert client.requests.pdus.encodes == 3
        assert client.requests.kept == 0  # acknowledged: nothing held for a retry
        # A new transaction with the same PDUs (another destination's, say) re-signs
        # but does not re-encode the PDUs.
        answers.append(200)
        assert (await client.send_transaction(attempt("t2"))).outcome is Outcome.SUCCESS
        assert (client.requests.encodes, client.requests.signatures) == (2, 2)
        assert client.requests.pdus.encodes == 3
        assert client.signature_counts == (2, 0)  # what the metrics export
    (r1, body1), (r2, body2), (_r3, body3) = remote.requests
    assert body1 == body2 and body3 != body1
    assert r1.headers["Authorization"] == r2.headers["Authorization"]
    assert json.loads(body1)["pdus"] == pdus
