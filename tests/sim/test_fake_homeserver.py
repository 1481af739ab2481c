"""The single-port FakeHomeserver uses the same receiving side as the sim's FakeRemote:
X-Matrix verification and seeded random faults are available to it too, per
destination, routed by the Host header."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from sim_support import ORIGIN

from federation_sender.testing.fake_homeserver import FakeHomeserver
from federation_sender.testing.faults import FaultProfile
from federation_sender.transport.signing import SigningKey, VerifyKeyLookup, sign_request


@pytest.fixture
async def verifying(lookup: VerifyKeyLookup) -> AsyncIterator[FakeHomeserver]:
    hs = FakeHomeserver(lookup_key=lookup)
    await hs.start()
    yield hs
    await hs.close()


async def _put(
    hs: FakeHomeserver,
    session: aiohttp.ClientSession,
    key: SigningKey | None,
    *,
    host: str,
    signed_for: str,
    txn_id: str = "t1",
) -> tuple[int, Any]:
    body = {"origin": ORIGIN, "origin_server_ts": 1, "pdus": [], "edus": []}
    uri = f"/_matrix/federation/v1/send/{txn_id}"
    headers = {"Host": host}
    if key is not None:
        headers["Authorization"] = sign_request(
            key=key, origin=ORIGIN, destination=signed_for, method="PUT", uri=uri, content=body
        )
    async with session.put(hs.url + uri, json=body, headers=headers) as resp:
        return resp.status, await resp.json(content_type=None)


async def test_verifies_signatures_for_the_destination_named_by_host(
    verifying: FakeHomeserver, session: aiohttp.ClientSession, signing_key: SigningKey
) -> None:
    hs = verifying
    assert (await _put(hs, session, signing_key, host="a.test", signed_for="a.test"))[0] == 200
    status, body = await _put(hs, session, signing_key, host="b.test", signed_for="a.test")
    assert (status, body["errcode"]) == (401, "M_UNAUTHORIZED")
    assert (await _put(hs, session, None, host="b.test", signed_for="b.test"))[0] == 401
    # The same txn id again: answered, recorded as a duplicate, not processed twice.
    assert (await _put(hs, session, signing_key, host="a.test", signed_for="a.test"))[0] == 200
    assert [(t.txn_id, t.duplicate) for t in hs.attempts["a.test"]] == [
        ("t1", False),
        ("t1", True),
    ]
    assert hs.txn_counts["a.test"] == 1 and hs.records["a.test"].retransmits == 1
    assert hs.records["b.test"].outcomes["401"] == 2 and "b.test" not in hs.txn_counts


async def test_seeded_faults_per_destination(session: aiohttp.ClientSession) -> None:
    hs = FakeHomeserver()
    await hs.start()
    try:
        hs.set_faults("bad.test", FaultProfile(error_rate=1.0), random.Random(1))
        assert (await _put(hs, session, None, host="bad.test", signed_for=""))[0] == 500
        assert (await _put(hs, session, None, host="good.test", signed_for=""))[0] == 200
        assert hs.records["bad.test"].outcomes == {"500": 1}
        assert hs.accepted("bad.test") == [] and len(hs.accepted("good.test")) == 1
    finally:
        await hs.close()


async def test_serves_tls_with_the_leaf_it_is_given(
    tmp_path: Any, signing_key: SigningKey
) -> None:
    """``start(ssl_context=...)`` serves HTTPS (``url`` says so); a client trusting the
    CA delivers, one that does not is refused at the handshake."""
    import ssl

    from federation_sender.testing.certs import LoopbackCA

    leaf = LoopbackCA.create(tmp_path).issue(tmp_path, ["127.0.0.1"])
    hs = FakeHomeserver()
    await hs.start(ssl_context=leaf.server_context())
    try:
        assert hs.url.startswith("https://127.0.0.1:")
        trusting = aiohttp.TCPConnector(
            ssl=ssl.create_default_context(cafile=str(leaf.ca_cert)))
        async with aiohttp.ClientSession(connector=trusting) as s:
            status, _ = await _put(hs, s, signing_key, host="a.test", signed_for="a.test")
        assert status == 200
        assert [t.txn_id for t in hs.accepted("a.test")] == ["t1"]
        async with aiohttp.ClientSession() as s:
            with pytest.raises(aiohttp.ClientConnectorCertificateError):
                await _put(hs, s, signing_key, host="a.test", signed_for="a.test",
                           txn_id="t2")
    finally:
        await hs.close()
