"""Security properties as tests, at the level an operator sees them.

Unit-level checks already exist and are not repeated here: the auth middleware on a
fixed route list (``tests/admin/test_admin_auth.py``), key-file modes on
``load_signing_key`` (``tests/transport/test_signing.py``), the address filter table
(``tests/transport/test_policy_and_keys.py``), redaction patterns
(``tests/telemetry/test_telemetry_logging.py``), response-size limits
(``tests/transport/test_client.py``) and the replication line limit
(``tests/replication/test_repl_connection.py``). These tests check the same promises
end to end: every route the app *actually has*, the defaults the composition root
builds from an empty configuration, and the log output of a running worker that talks
to a hostile peer.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import stat
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from sqlalchemy.ext.asyncio import AsyncEngine

from federation_sender.admin.app import build_admin_app, openapi_document
from federation_sender.admin.middleware import CLIENT_PREFIX, OPEN_ADMIN_PATHS
from federation_sender.app.worker import Worker
from federation_sender.builders import (
    build_federation_client,
    load_or_create_admin_token,
    load_or_create_signing_key,
)
from federation_sender.config import (
    AdminSettings,
    DatabaseSettings,
    FederationSettings,
    QueueSettings,
    ReplicationSettings,
    Settings,
    TelemetrySettings,
)
from federation_sender.storage.backend import NativeBackend
from federation_sender.storage.engine import create_engine
from federation_sender.storage.migrate import upgrade
from federation_sender.telemetry.logging import setup_logging
from federation_sender.testing.admin_fakes import FakeQueueControl
from federation_sender.testing.certs import CertFiles, make_certs
from federation_sender.testing.clock import FakeClock
from federation_sender.testing.ports import free_port
from federation_sender.testing.queue_writer import HomeserverWriter
from federation_sender.testing.waiting import wait_until
from federation_sender.transport.result import Outcome, Transaction
from federation_sender.transport.signing import KeyFileError, SigningKey, parse_x_matrix

TOKEN = "Zr7-admin-token-that-must-never-be-logged"
ADMIN = "/_synapse/admin/"


@pytest.fixture
async def sqlite_engine(sqlite_url: str) -> AsyncIterator[AsyncEngine]:
    eng = create_engine(sqlite_url)
    await upgrade(eng)
    yield eng
    await eng.dispose()


def _admin_routes(app: web.Application) -> list[tuple[str, str]]:
    """Every (method, concrete path) the app serves under the admin prefix, and the
    client-API routes synapse-admin logs in through."""
    out: list[tuple[str, str]] = []
    for route in app.router.routes():
        if route.method in ("HEAD", "OPTIONS") or route.resource is None:
            continue
        info = route.resource.get_info()
        path = str(info.get("path") or info.get("formatter"))
        if path.startswith((ADMIN, CLIENT_PREFIX)):
            out.append((route.method, re.sub(r"\{[^}]+\}", "example.org", path)))
    return out


async def test_every_admin_route_refuses_missing_wrong_and_smuggled_tokens(
    sqlite_engine: AsyncEngine,
) -> None:
    app = build_admin_app(
        storage=NativeBackend(sqlite_engine), token=TOKEN, queues=FakeQueueControl(sqlite_engine),
        clock=FakeClock(),
    )
    all_routes = _admin_routes(app)
    documented = {
        (m.upper(), p) for p, ops in openapi_document()["paths"].items() for m in ops
        if p.startswith((ADMIN, CLIENT_PREFIX))
    }
    assert len(all_routes) == len(documented) >= 6  # no route escapes this test
    # The open ones are exactly those the middleware names (server_version and the
    # client API's versions, open in Synapse too); each answers without a token and
    # carries no destination data. whoami refuses like every admin route.
    open_routes = [(m, p) for m, p in all_routes if p in OPEN_ADMIN_PATHS]
    assert sorted(p for _, p in open_routes) == sorted(OPEN_ADMIN_PATHS)
    routes = [r for r in all_routes if r not in open_routes]
    # Unknown routes and methods under the prefix must not reveal themselves either.
    routes += [("GET", ADMIN + "v1/federation/nope"), ("DELETE", ADMIN + "v1/federation/summary"),
               ("PUT", ADMIN + "v2/users/@a:b")]
    refusals = [
        ({}, {}, "M_MISSING_TOKEN"),
        ({"Authorization": "Bearer"}, {}, "M_MISSING_TOKEN"),
        ({"Authorization": f"Basic {TOKEN}"}, {}, "M_MISSING_TOKEN"),
        ({"Authorization": f"Token {TOKEN}"}, {}, "M_MISSING_TOKEN"),
        ({"Authorization": "Bearer wrong"}, {}, "M_UNKNOWN_TOKEN"),
        ({"Authorization": f"Bearer {TOKEN[:-1]}"}, {}, "M_UNKNOWN_TOKEN"),
        ({"Authorization": f"Bearer {TOKEN}\u00e9"}, {}, "M_UNKNOWN_TOKEN"),
        ({}, {"access_token": TOKEN}, "M_MISSING_TOKEN"),
        ({"Cookie": f"access_token={TOKEN}"}, {}, "M_MISSING_TOKEN"),
        ({"X-Access-Token": TOKEN}, {}, "M_MISSING_TOKEN"),
    ]
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        for method, path in routes:
            for headers, params, errcode in refusals:
                resp = await client.request(method, path, headers=headers, params=params)
                assert resp.status == 401, (method, path, headers, params)
                body = await resp.json()
                assert body["errcode"] == errcode, (method, path, headers, body)
                assert TOKEN not in json.dumps(body)
            ok = await client.request(method, path, headers={"Authorization": f"Bearer {TOKEN}"})
            assert ok.status != 401
        for method, path in open_routes:
            resp = await client.request(method, path)
            assert resp.status == 200, (method, path)
            # Version facts only, no destination data.
            want = {"server_version"} if path.startswith(ADMIN) else {"versions",
                                                                      "unstable_features"}
            assert set(await resp.json()) == want, path


async def _raw_get(port: int, target: str, extra: bytes = b"") -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"GET " + target.encode() + b" HTTP/1.1\r\nHost: a\r\nConnection: close\r\n"
        + extra + b"\r\n"
    )
    await writer.drain()
    data = await reader.read()
    writer.close()
    status = int(data.split(b" ", 2)[1])
    return status, data


@pytest.mark.parametrize("target", [
    "//_synapse/admin/v1/federation/destinations",
    "/_synapse//admin/v1/federation/destinations",
    "/_synapse/%61dmin/v1/federation/destinations",
    "/_synapse/admin/v1/federation/destinations/",
    "/./_synapse/admin/v1/federation/destinations",
    "/health/../_synapse/admin/v1/federation/summary",
    "/_SYNAPSE/admin/v1/federation/summary",
    "/_synapse/admin/v1/federation/destinations/%2e%2e/summary",
    "http://evil/_synapse/admin/v1/federation/summary",
])
async def test_path_tricks_never_reach_a_handler_without_the_token(
    sqlite_engine: AsyncEngine, target: str
) -> None:
    app = build_admin_app(
        storage=NativeBackend(sqlite_engine), token=TOKEN, queues=FakeQueueControl(),
        clock=FakeClock(),
    )
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        assert client.port is not None
        status, body = await _raw_get(client.port, target)
    assert status in (401, 404), (target, body)
    assert b'"destinations"' not in body and b'"total"' not in body


async def test_admin_request_size_limits(sqlite_engine: AsyncEngine) -> None:
    """Huge headers are refused by the HTTP parser (4xx, not a crash); bodies are capped
    at aiohttp's 1 MiB default and no admin route reads one anyway."""
    app = build_admin_app(
        storage=NativeBackend(sqlite_engine), token=TOKEN, queues=FakeQueueControl(),
        clock=FakeClock(),
    )
    assert app._client_max_size <= 1024 * 1024
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        assert client.port is not None
        status, _ = await _raw_get(client.port, "/health", b"X-Big: " + b"a" * 100_000 + b"\r\n")
        assert 400 <= status < 500
        many = b"".join(b"X-H%d: v\r\n" % i for i in range(1000))
        status, _ = await _raw_get(client.port, "/health", many)
        assert status < 500
        status, _ = await _raw_get(client.port, "/" + "a" * 100_000)
        assert 400 <= status < 500
        # A file-like body: aiohttp warns (ResourceWarning) that raw bytes this large
        # would be written in one blocking step.
        resp = await client.post(
            ADMIN + "v1/federation/destinations/example.org/reset_connection",
            data=io.BytesIO(b"x" * (4 * 1024 * 1024)), headers={"Authorization": f"Bearer {TOKEN}"},
        )
        assert resp.status < 500
        # The server is still healthy afterwards.
        assert (await client.get("/health")).status == 200


# --- keys and tokens on disk -------------------------------------------------------------


def test_generated_key_and_token_are_private_and_unsafe_keys_are_refused(
    tmp_path: Path,
) -> None:
    key_path = tmp_path / "data" / "signing.key"
    load_or_create_signing_key(str(key_path))
    assert stat.S_IMODE(key_path.stat().st_mode) == 0o600
    settings = Settings(data_dir=str(tmp_path / "data"))
    token = load_or_create_admin_token(settings)
    token_file = tmp_path / "data" / "admin.token"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert len(token) >= 32
    for mode in (0o644, 0o604, 0o620, 0o666):
        os.chmod(key_path, mode)
        with pytest.raises(KeyFileError):
            load_or_create_signing_key(str(key_path))


async def test_worker_refuses_to_start_with_a_key_others_can_read(tmp_path: Path) -> None:
    key_path = tmp_path / "signing.key"
    load_or_create_signing_key(str(key_path))
    os.chmod(key_path, 0o644)
    settings = Settings(
        data_dir=str(tmp_path),
        database=DatabaseSettings(url=f"sqlite:///{tmp_path}/w.db"),
        federation=FederationSettings(signing_key_path=str(key_path)),
        admin=AdminSettings(token=TOKEN),
    )
    with pytest.raises(KeyFileError):
        await Worker.create(settings)


# --- outbound defaults ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def untrusted_certs(tmp_path_factory: pytest.TempPathFactory) -> CertFiles:
    return make_certs(tmp_path_factory.mktemp("untrusted"), ["127.0.0.1", "localhost"])


@pytest.fixture
async def tls_server(untrusted_certs: CertFiles) -> AsyncIterator[tuple[int, list[str]]]:
    """A TLS /send endpoint with a certificate from a CA nobody trusts."""
    seen: list[str] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append(request.path)
        return web.json_response({"pdus": {}})

    app = web.Application()
    app.router.add_put("/_matrix/federation/v1/send/{txn}", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=untrusted_certs.server_context())
    await site.start()
    yield site._server.sockets[0].getsockname()[1], seen  # type: ignore[union-attr]
    await runner.cleanup()


def _txn(destination: str) -> Transaction:
    return Transaction(destination=destination, txn_id="t1", pdus=[],
                       edus=[{"edu_type": "m.test", "content": {}}])


async def test_default_settings_verify_tls_and_refuse_private_addresses(
    tls_server: tuple[int, list[str]],
) -> None:
    port, seen = tls_server
    defaults = Settings().federation
    assert defaults.verify_tls and defaults.use_tls and defaults.ip_allow_list == []
    key = SigningKey.generate("a_test")
    dest = "peer.test"
    # Defaults only, plus an override so no real DNS is asked: private address refused.
    override = {dest: f"127.0.0.1:{port}"}
    settings = Settings(federation=FederationSettings(destination_overrides=override))
    async with build_federation_client(settings, key, FakeClock()) as client:
        refused = await client.send_transaction(_txn(dest))
    assert refused.outcome is Outcome.TRANSIENT
    assert "refused by the outbound policy" in refused.error
    # Allow loopback, keep every other default: the untrusted certificate is refused.
    settings = Settings(federation=FederationSettings(
        destination_overrides={dest: f"127.0.0.1:{port}"}, ip_allow_list=["127.0.0.0/8"]))
    async with build_federation_client(settings, key, FakeClock()) as client:
        untrusted = await client.send_transaction(_txn(dest))
    assert untrusted.outcome is Outcome.TRANSIENT and "TLS" in untrusted.error, untrusted
    assert seen == []  # nothing ever reached the server


# --- logs --------------------------------------------------------------------------------


async def test_no_secret_reaches_the_logs_of_a_running_worker(tmp_path: Path) -> None:
    """A worker at DEBUG talks to a peer that echoes our Authorization header and body
    back in its error messages, and serves admin calls with right and wrong tokens;
    neither the admin token, nor the signing key seed, nor a request signature appears
    in what it logs."""
    seen_auth: list[str] = []

    async def echo(request: web.Request) -> web.Response:
        auth = request.headers.get("Authorization", "")
        seen_auth.append(auth)
        body = (await request.read()).decode()[:200]
        status = 401 if len(seen_auth) % 2 else 500
        return web.json_response(
            {"errcode": "M_UNAUTHORIZED", "error": f"bad header {auth}; body {body}"},
            status=status,
        )

    peer = web.Application()
    peer.router.add_put("/_matrix/federation/v1/send/{txn}", echo)
    peer_runner = web.AppRunner(peer, access_log=None)
    await peer_runner.setup()
    peer_site = web.TCPSite(peer_runner, "127.0.0.1", 0)
    await peer_site.start()
    peer_port = peer_site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    db_url = f"sqlite:///{tmp_path}/worker.db"
    key_path = tmp_path / "signing.key"
    admin_port = free_port()
    settings = Settings(
        server_name="local.test",
        data_dir=str(tmp_path),
        database=DatabaseSettings(url=db_url),
        replication=ReplicationSettings(transport="none", poll_interval_s=0.1),
        federation=FederationSettings(
            signing_key_path=str(key_path), use_tls=False, ip_allow_list=["127.0.0.0/8"],
            request_timeout_s=5.0,
            destination_overrides={"peer.test": f"127.0.0.1:{peer_port}"},
        ),
        queue=QueueSettings(backoff_initial_s=0.2, backoff_max_s=0.5, wakeup_interval_s=0.2),
        admin=AdminSettings(port=admin_port, token=TOKEN),
        telemetry=TelemetrySettings(metrics_port=None, log_level="DEBUG"),
    )
    out = io.StringIO()
    worker = await Worker.create(settings)
    setup_logging(settings.telemetry, stream=out, secrets=[worker.admin_token])
    seed = key_path.read_text().split()[2]
    try:
        await worker.start()
        writer = await HomeserverWriter(create_engine(db_url), "local.test").init()
        room = "!r:local.test"
        await writer.join(room, "@alice:local.test")
        await writer.join(room, "@bob:peer.test")
        await writer.messages(room, "@alice:local.test", 3)
        await wait_until(lambda: len(seen_auth), "three signed requests at the peer",
                         accept=lambda n: n >= 3, timeout_s=10, every_s=0.05,
                         details=lambda: out.getvalue()[-2000:])
        base = f"http://127.0.0.1:{admin_port}{ADMIN}v1/federation/destinations"
        async with aiohttp.ClientSession() as http:
            for auth in (f"Bearer {TOKEN}", f"Bearer {TOKEN}x", f"Basic {TOKEN}"):
                async with http.get(base, headers={"Authorization": auth}) as r:
                    await r.read()
            async with http.get(base, params={"access_token": TOKEN}) as r:
                await r.read()
        await writer.engine.dispose()
    finally:
        await worker.stop(deadline_s=2.0)
        await peer_runner.cleanup()
        setup_logging(TelemetrySettings())
    logged = out.getvalue()
    # The echo did reach the logs, redacted.
    assert "peer.test" in logged and "HTTP 401" in logged and "<redacted>" in logged
    sigs = [parse_x_matrix(a).sig for a in seen_auth if a]
    assert sigs
    for secret in [TOKEN, seed, *sigs]:
        assert secret not in logged, secret


async def test_wrong_method_is_405_with_allow_header(sqlite_engine: AsyncEngine) -> None:
    """Regression (found by schemathesis): the JSON error middleware dropped the
    ``Allow`` header RFC 9110 requires on a 405."""
    app = build_admin_app(
        storage=NativeBackend(sqlite_engine), token=TOKEN, queues=FakeQueueControl(),
        clock=FakeClock(),
    )
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        for method, path in [("PUT", "/health"), ("DELETE", ADMIN + "v1/federation/summary")]:
            resp = await client.request(method, path, headers={"Authorization": f"Bearer {TOKEN}"})
            assert resp.status == 405
            assert "GET" in resp.headers["Allow"]
            assert (await resp.json())["errcode"] == "M_UNRECOGNIZED"
