"""The served OpenAPI document is valid, lists exactly the app's routes, and real
responses (success and error) match the schemas it documents for their status."""

from __future__ import annotations

import re
from typing import Any

import jsonschema
import pytest
from admin_helpers import AUTH, add_destinations, add_rooms
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from openapi_spec_validator import validate
from sqlalchemy.ext.asyncio import AsyncEngine

from federation_sender.admin.app import build_admin_app, openapi_document
from federation_sender.storage.backend import NativeBackend
from federation_sender.testing.admin_fakes import FakeQueueControl, seed_destinations
from federation_sender.testing.clock import FakeClock


def documented_routes(doc: dict[str, Any]) -> set[tuple[str, str]]:
    return {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops}


def app_routes(app: web.Application) -> set[tuple[str, str]]:
    out = set()
    for route in app.router.routes():
        if route.method in ("HEAD", "OPTIONS"):
            continue
        info = route.resource.get_info() if route.resource else {}
        path = info.get("path") or info.get("formatter")
        out.add((route.method, str(path)))
    return out


def test_document_is_valid_openapi_31() -> None:
    doc = openapi_document()
    assert doc["openapi"].startswith("3.1")
    validate(doc)


def test_document_lists_exactly_the_routes(engine: AsyncEngine, clock: FakeClock) -> None:
    app = build_admin_app(
        storage=NativeBackend(engine), token="t", queues=FakeQueueControl(), clock=clock,
    )
    assert app_routes(app) == documented_routes(openapi_document())


def _match(doc: dict[str, Any], method: str, path: str) -> dict[str, Any]:
    for templ, ops in doc["paths"].items():
        pattern = "^" + re.sub(r"\\\{[^}]+\\\}", "[^/]+", re.escape(templ)) + "$"
        if re.match(pattern, path) and method.lower() in ops:
            op: dict[str, Any] = ops[method.lower()]
            return op
    raise AssertionError(f"undocumented {method} {path}")


def _response_schema(doc: dict[str, Any], op: dict[str, Any], status: int) -> dict[str, Any]:
    resp = op["responses"].get(str(status))
    assert resp is not None, f"status {status} not documented for {op['operationId']}"
    if "$ref" in resp:
        resp = doc["components"]["responses"][resp["$ref"].rsplit("/", 1)[1]]
    schema: dict[str, Any] = resp["content"]["application/json"]["schema"]
    return schema


CALLS: list[tuple[str, str, dict[str, str], bool]] = [
    ("GET", "/_synapse/admin/v1/federation/destinations", {"limit": "2"}, True),
    ("GET", "/_synapse/admin/v1/federation/destinations", {"limit": "x"}, True),
    ("GET", "/_synapse/admin/v1/federation/destinations", {}, False),
    ("GET", "/_synapse/admin/v1/federation/destinations/busy-0003.example.org", {}, True),
    ("GET", "/_synapse/admin/v1/federation/destinations/failing-0001.example.org", {}, True),
    ("GET", "/_synapse/admin/v1/federation/destinations/unknown.org", {}, True),
    ("GET", "/_synapse/admin/v1/federation/destinations/healthy-0000.example.org/rooms",
     {"limit": "1"}, True),
    ("GET", "/_synapse/admin/v1/federation/destinations/healthy-0000.example.org/rooms",
     {"dir": "z"}, True),
    ("GET", "/_synapse/admin/v1/federation/destinations/failing-0001.example.org/transactions",
     {}, True),
    ("POST", "/_synapse/admin/v1/federation/destinations/failing-0001.example.org/"
     "reset_connection", {}, True),
    ("POST", "/_synapse/admin/v1/federation/destinations/healthy-0000.example.org/"
     "reset_connection", {}, True),
    ("GET", "/_synapse/admin/v1/federation/summary", {}, True),
    ("GET", "/health", {}, False),
    ("GET", "/ready", {}, False),
    ("GET", "/_matrix/client/versions", {}, False),
    ("GET", "/_matrix/client/v3/account/whoami", {}, True),
    ("GET", "/_matrix/client/v3/account/whoami", {}, False),
]


async def test_responses_match_documented_schemas(engine: AsyncEngine,
                                                  clock: FakeClock) -> None:
    doc = openapi_document()
    queues = FakeQueueControl(engine)
    await seed_destinations(engine, clock, 8, queues=queues)
    await add_destinations(engine, [{"destination": "bare.org"}])
    await add_rooms(engine, "bare.org", {"!a:b": 1})
    app = build_admin_app(storage=NativeBackend(engine), token="s3cret-admin-token", queues=queues,
                          clock=clock)
    seen_statuses: set[int] = set()
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        for method, path, params, auth in CALLS:
            resp = await client.request(method, path, params=params,
                                        headers=AUTH if auth else {})
            body = await resp.json()
            seen_statuses.add(resp.status)
            schema = _response_schema(doc, _match(doc, method, path), resp.status)
            jsonschema.Draft202012Validator(
                {**schema, "components": doc["components"]}).validate(body)
    assert {200, 400, 401, 404} <= seen_statuses


@pytest.mark.parametrize("ready, status", [(True, 200), (False, 503)])
async def test_ready_reports_the_callable(engine: AsyncEngine, clock: FakeClock,
                                          ready: bool, status: int) -> None:
    async def check() -> bool:
        return ready

    for fn in (lambda: ready, check):
        app = build_admin_app(storage=NativeBackend(engine), token="t", queues=FakeQueueControl(),
                              clock=clock, ready=fn)
        async with TestClient(TestServer(app, host="127.0.0.1")) as client:
            resp = await client.get("/ready")
            assert resp.status == status
            assert await resp.json() == {"ready": ready}


class ExplodingQueues(FakeQueueControl):
    def live_state(self, destination: str) -> Any:
        raise RuntimeError("boom")


async def test_unexpected_errors_are_500_json(engine: AsyncEngine, clock: FakeClock,
                                              caplog: pytest.LogCaptureFixture) -> None:
    await add_destinations(engine, [{"destination": "x.org"}])
    app = build_admin_app(
        storage=NativeBackend(engine), token="t", queues=ExplodingQueues(), clock=clock,
    )
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        resp = await client.get("/_synapse/admin/v1/federation/destinations",
                                headers={"Authorization": "Bearer t"})
        assert resp.status == 500
        assert await resp.json() == {"errcode": "M_UNKNOWN", "error": "Internal server error"}
    assert "boom" in caplog.text
