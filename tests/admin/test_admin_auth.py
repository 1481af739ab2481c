from __future__ import annotations

from typing import Any

import pytest
from admin_helpers import AUTH, TOKEN
from aiohttp.test_utils import TestClient

LIST = "/_synapse/admin/v1/federation/destinations"


@pytest.mark.parametrize("headers, errcode", [
    ({}, "M_MISSING_TOKEN"),
    ({"Authorization": "Bearer wrong"}, "M_UNKNOWN_TOKEN"),
    ({"Authorization": f"Bearer {TOKEN}x"}, "M_UNKNOWN_TOKEN"),
    ({"Authorization": f"Basic {TOKEN}"}, "M_MISSING_TOKEN"),
    ({"Authorization": "Bearer "}, "M_MISSING_TOKEN"),
])
async def test_admin_routes_need_the_token(client: TestClient[Any, Any],
                                           headers: dict[str, str], errcode: str) -> None:
    for method, path in [("GET", LIST), ("GET", LIST + "/a.org"),
                         ("GET", LIST + "/a.org/rooms"),
                         ("POST", LIST + "/a.org/reset_connection"),
                         ("GET", "/_synapse/admin/v1/federation/summary"),
                         ("GET", "/_synapse/admin/v1/no/such/route")]:
        resp = await client.request(method, path, headers=headers)
        assert resp.status == 401, (method, path)
        assert (await resp.json())["errcode"] == errcode


async def test_token_in_query_string_is_not_accepted(client: TestClient[Any, Any]) -> None:
    resp = await client.get(LIST, params={"access_token": TOKEN})
    assert resp.status == 401


async def test_right_token_passes_and_scheme_is_case_insensitive(
        client: TestClient[Any, Any]) -> None:
    assert (await client.get(LIST, headers=AUTH)).status == 200
    resp = await client.get(LIST, headers={"Authorization": f"bearer {TOKEN}"})
    assert resp.status == 200


@pytest.mark.parametrize("path", ["/health", "/ready", "/openapi.json", "/dashboard",
                                  "/_synapse/admin/v1/server_version"])
async def test_open_routes(client: TestClient[Any, Any], path: str) -> None:
    assert (await client.get(path)).status == 200


async def test_cors_preflight_without_token(client: TestClient[Any, Any]) -> None:
    resp = await client.options(LIST, headers={"Origin": "https://admin.example",
                                               "Access-Control-Request-Method": "GET"})
    assert resp.status == 204
    assert resp.headers["Access-Control-Allow-Origin"] == "*"
    assert "Authorization" in resp.headers["Access-Control-Allow-Headers"]
    resp = await client.get(LIST, headers=AUTH)
    assert resp.headers["Access-Control-Allow-Origin"] == "*"


async def test_empty_token_is_refused() -> None:
    from federation_sender.admin.middleware import make_auth_middleware

    with pytest.raises(ValueError):
        make_auth_middleware("")


WHOAMI = "/_matrix/client/v3/account/whoami"


async def test_synapse_admin_can_log_in_with_the_admin_token(
        client: TestClient[Any, Any]) -> None:
    """synapse-admin's access-token login asks the client API's versions, then whoami."""
    versions = await client.get("/_matrix/client/versions")
    assert versions.status == 200
    assert "v1.1" in (await versions.json())["versions"]
    me = await client.get(WHOAMI, headers=AUTH)
    assert me.status == 200
    assert await me.json() == {"user_id": "@federation-sender-admin:localhost",
                               "is_guest": False}
    assert me.headers["Access-Control-Allow-Origin"] == "*"
    for headers, errcode in [({}, "M_MISSING_TOKEN"),
                             ({"Authorization": "Bearer wrong"}, "M_UNKNOWN_TOKEN")]:
        refused = await client.get(WHOAMI, headers=headers)
        assert refused.status == 401
        assert (await refused.json())["errcode"] == errcode
    preflight = await client.options(WHOAMI, headers={
        "Origin": "https://admin.example", "Access-Control-Request-Method": "GET",
        "Access-Control-Request-Headers": "authorization"})
    assert preflight.status == 204
    assert preflight.headers["Access-Control-Allow-Origin"] == "*"
