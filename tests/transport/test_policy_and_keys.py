"""Address policy, response classification and the key endpoint (pure parts)."""

from __future__ import annotations

import pytest
from aiohttp.test_utils import TestClient, TestServer

from federation_sender.testing.clock import FakeClock
from federation_sender.transport.addresses import AddressFilter, parse_networks
from federation_sender.transport.classify import classify_response, retry_after_s
from federation_sender.transport.keyserver import make_key_app, parse_server_keys
from federation_sender.transport.result import Outcome
from federation_sender.transport.signing import AuthenticationError, SigningKey


@pytest.mark.parametrize(
    "address",
    ["127.0.0.1", "10.1.2.3", "172.16.0.1", "192.168.1.1", "169.254.169.254", "100.64.0.1",
     "0.0.0.0", "224.0.0.1", "255.255.255.255", "::1", "::", "fe80::1", "fc00::1",
     "::ffff:127.0.0.1", "::ffff:10.0.0.1", "2002:7f00:1::1", "64:ff9b::7f00:1",
     "2001:db8::1", "198.18.0.1", "not an ip"],
)  # fmt: skip
def test_reserved_addresses_are_refused_by_default(address: str) -> None:
    assert not AddressFilter().is_allowed(address)


@pytest.mark.parametrize("address", ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111"])
def test_public_addresses_are_allowed(address: str) -> None:
    assert AddressFilter().is_allowed(address)


def test_allow_list_overrides_including_mapped_addresses() -> None:
    allow = AddressFilter(parse_networks(["127.0.0.0/8", "::1", "10.5.0.0/16"]))
    assert allow.is_allowed("127.0.0.53")
    assert allow.is_allowed("::ffff:127.0.0.1")
    assert allow.is_allowed("10.5.9.9")
    assert not allow.is_allowed("10.6.0.1")
    with pytest.raises(ValueError):
        parse_networks(["nonsense"])


def test_classification_table() -> None:
    json_headers = {"content-type": "application/json; charset=utf-8"}
    ok = classify_response(200, json_headers, b'{"pdus": {"$a": {"error": "x"}, "$b": {}}}')
    assert (ok.outcome, dict(ok.pdu_errors)) == (Outcome.SUCCESS, {"$a": "x"})
    assert classify_response(200, json_headers, b'{"pdus": []}').pdu_errors == {}
    assert classify_response(408, {}, b"").outcome is Outcome.TRANSIENT
    assert classify_response(404, {}, b"").outcome is Outcome.PERMANENT
    assert classify_response(503, {}, b"").outcome is Outcome.TRANSIENT
    long_error = b'{"errcode": "M_X", "error": "' + b"e" * 1000 + b'"}'
    assert len(classify_response(400, json_headers, long_error).error) < 250


def test_retry_after() -> None:
    assert retry_after_s({"retry_after_ms": 2500}, {}) == 2.5
    assert retry_after_s(None, {"retry-after": "7"}) == 7.0
    assert retry_after_s({"retry_after_ms": True}, {}) is None
    assert retry_after_s({"retry_after_ms": 10**12}, {}) == 24 * 3600
    assert retry_after_s(None, {"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}) is None


async def test_key_endpoint_serves_a_self_signed_document() -> None:
    key = SigningKey.generate("a_k")
    clock = FakeClock()
    app = make_key_app(server_name="me.test", signing_key=key, clock=clock)
    async with TestClient(TestServer(app)) as client:
        for path in ("/_matrix/key/v2/server", "/_matrix/key/v2/server/ed25519:a_k"):
            response = await client.get(path)
            assert response.status == 200
            body = await response.json()
            keys = parse_server_keys(body, server_name="me.test", now_ms=int(clock.time_s() * 1000))
            assert list(keys) == ["ed25519:a_k"]
            assert body["verify_keys"]["ed25519:a_k"]["key"] == key.verify_key_base64
    now_ms = int(clock.time_s() * 1000)
    with pytest.raises(AuthenticationError):
        parse_server_keys(body, server_name="other.test", now_ms=now_ms)
    with pytest.raises(AuthenticationError):
        parse_server_keys(body, server_name="me.test", now_ms=now_ms + 2 * 86400 * 1000)
    tampered = dict(
        body, verify_keys={"ed25519:a_k": {"key": SigningKey.generate().verify_key_base64}}
    )
    with pytest.raises(AuthenticationError):
        parse_server_keys(tampered, server_name="me.test", now_ms=now_ms)
