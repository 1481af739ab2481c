"""Fixtures for the simulator tests: our signing key and a signed /send client."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from sim_support import ORIGIN, PutTxn

from federation_sender.sim.remotes import FakeRemote
from federation_sender.transport.signing import (
    SigningKey,
    VerifyKeyLookup,
    sign_request,
    verify_key_lookup,
)


@pytest.fixture
def signing_key() -> SigningKey:
    return SigningKey.generate("sim1")


@pytest.fixture
def lookup(signing_key: SigningKey) -> VerifyKeyLookup:
    return verify_key_lookup({ORIGIN: {signing_key.key_id: signing_key.verify_key}})


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


@pytest.fixture
def put_txn(session: aiohttp.ClientSession, signing_key: SigningKey) -> PutTxn:
    """``await put_txn(remote, txn_id, pdus=[], edus=[], key=..., destination=...)``.

    Returns ``(status, parsed JSON or text)``; connection errors propagate.
    """

    async def put(
        remote: FakeRemote,
        txn_id: str,
        *,
        pdus: list[dict[str, Any]] | None = None,
        edus: list[dict[str, Any]] | None = None,
        key: SigningKey | None = None,
        destination: str | None = None,
        authorization: str | None = None,
    ) -> tuple[int, Any]:
        body = {
            "origin": ORIGIN,
            "origin_server_ts": 1,
            "pdus": pdus or [],
            "edus": edus or [],
        }
        uri = f"/_matrix/federation/v1/send/{txn_id}"
        if authorization is None:
            authorization = sign_request(
                key=key or signing_key,
                origin=ORIGIN,
                destination=destination or remote.server_name,
                method="PUT",
                uri=uri,
                content=body,
            )
        headers = {"Authorization": authorization} if authorization else {}
        async with session.put(f"http://{remote.address}{uri}", json=body, headers=headers) as resp:
            text = await resp.text()
            try:
                return resp.status, await resp.json(content_type=None)
            except ValueError:
                return resp.status, text

    return put
