"""Loopback-only fixtures: a test CA, a DNS server, TLS federation servers."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web

from federation_sender.clock import SystemClock
from federation_sender.testing.certs import CertFiles, make_certs
from federation_sender.testing.clock import FakeClock
from federation_sender.transport.client import FederationClient
from federation_sender.transport.signing import SigningKey

from .dns_server import LoopbackDns, start_dns

TLS_NAMES = [
    "localhost",
    "127.0.0.1",
    "::1",
    "remote.test",
    "wk.test",
    "delegated.test",
    "target.test",
]
LOOPBACK = ("127.0.0.0/8", "::1/128")
ORIGIN = "origin.test"


def make_client(certs: CertFiles, key: SigningKey, **overrides: Any) -> FederationClient:
    """A client of ``ORIGIN`` that trusts the test CA and may reach loopback."""
    settings: dict[str, Any] = {
        "server_name": ORIGIN,
        "signing_key": key,
        "clock": SystemClock(),
        "attempt_timeout_s": 5.0,
        "tls_extra_ca_file": str(certs.ca_cert),
        "ip_allow_list": LOOPBACK,
    }
    settings.update(overrides)
    return FederationClient(**settings)


@pytest.fixture(scope="session")
def certs(tmp_path_factory: pytest.TempPathFactory) -> CertFiles:
    return make_certs(tmp_path_factory.mktemp("ca"), TLS_NAMES)


@pytest.fixture(scope="session")
def our_key() -> SigningKey:
    return SigningKey.generate("a_ours")


@pytest.fixture
async def dns_server() -> AsyncIterator[LoopbackDns]:
    server = await start_dns()
    yield server
    assert server.transport is not None
    server.transport.close()


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass
class FakeRemote:
    """An aiohttp TLS server on loopback that records what it receives."""

    port: int = 0
    handler: Handler | None = None
    requests: list[tuple[web.Request, bytes]] = field(default_factory=list)
    sni: list[str | None] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.requests.append((request, body))
        if self.handler is None:
            return web.json_response({"pdus": {}})
        return await self.handler(request)


async def start_remote(
    certs: CertFiles, host: str = "127.0.0.1"
) -> tuple[FakeRemote, web.AppRunner]:
    remote = FakeRemote()
    ctx = certs.server_context()

    def on_sni(_sock: ssl.SSLObject, name: str | None, _ctx: ssl.SSLContext) -> None:
        remote.sni.append(name)

    ctx.sni_callback = on_sni  # type: ignore[assignment]
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", remote._dispatch)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, 0, ssl_context=ctx)
    await site.start()
    remote.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return remote, runner


@pytest.fixture
async def remote(certs: CertFiles) -> AsyncIterator[FakeRemote]:
    server, runner = await start_remote(certs)
    yield server
    await runner.cleanup()


RawHandler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@dataclass
class RawRemote:
    """A TLS socket server whose handler writes whatever bytes it likes."""

    handler: RawHandler
    port: int = 0
    connections: int = 0

    @property
    def name(self) -> str:
        return f"127.0.0.1:{self.port}"


@pytest.fixture
async def raw_remote(certs: CertFiles) -> AsyncIterator[RawRemote]:
    async def idle(_r: asyncio.StreamReader, _w: asyncio.StreamWriter) -> None:
        return None

    remote = RawRemote(idle)
    tasks: set[asyncio.Task[None]] = set()

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        remote.connections += 1
        task = asyncio.current_task()
        assert task is not None
        tasks.add(task)
        try:
            await remote.handler(reader, writer)
        except (ConnectionError, ssl.SSLError, asyncio.CancelledError):
            pass  # the client hung up, or teardown cancelled a dawdling handler
        finally:
            writer.close()
            tasks.discard(task)

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0, ssl=certs.server_context())
    remote.port = server.sockets[0].getsockname()[1]
    yield remote
    server.close()
    for t in list(tasks):
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await server.wait_closed()


@pytest.fixture
def fake_clock() -> FakeClock:
    return FakeClock()
