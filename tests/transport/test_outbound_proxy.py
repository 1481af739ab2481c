"""The outbound federation proxy (``matrix-federation://``) against loopback remotes.

The caller's side is written by hand on a socket, as Synapse's ProxyAgent writes it:
an absolute-form request line and ``Proxy-Authorization: Bearer <secret>``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from federation_sender.clock import SystemClock
from federation_sender.testing.certs import CertFiles
from federation_sender.transport.client import FederationClient
from federation_sender.transport.outbound_proxy import (
    BYTES_METRIC,
    REQUESTS_METRIC,
    OutboundProxyServer,
    ProxyLocation,
)
from federation_sender.transport.signing import SigningKey

from .conftest import FakeRemote, make_client

SECRET = "s3cret-replication"


@dataclass
class Proxy:
    server: OutboundProxyServer
    client: FederationClient
    registry: CollectorRegistry

    @property
    def port(self) -> int:
        assert self.server.port is not None
        return self.server.port

    def count(self, method: str, code: str) -> float:
        value = self.registry.get_sample_value(
            REQUESTS_METRIC + "_total", {"method": method, "code": code}
        )
        return value or 0.0


@pytest.fixture
async def proxy(certs: CertFiles, our_key: SigningKey) -> AsyncIterator[Proxy]:
    registry = CollectorRegistry()
    async with make_client(certs, our_key, attempt_timeout_s=5.0) as client:
        server = OutboundProxyServer(
            client, secret=SECRET, location=ProxyLocation(host="127.0.0.1", port=0),
            clock=SystemClock(), registry=registry, forward_timeout_s=1.0,
        )  # fmt: skip
        await server.start()
        yield Proxy(server, client, registry)
        await server.close()


async def _request(port: int, head: str, body: bytes = b"") -> tuple[int, dict[str, str], bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head.replace("\n", "\r\n").encode() + b"\r\n" + body)
        await writer.drain()
        return await _read_response(reader)
    finally:
        writer.close()


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    status = int(head[0].split(" ")[1])
    headers = {}
    for line in head[1:]:
        if line:
            k, _, v = line.partition(":")
            headers[k.lower()] = v.strip()
    if headers.get("transfer-encoding") == "chunked":
        body = bytearray()
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            if not size:
                await reader.readuntil(b"\r\n")
                return status, headers, bytes(body)
            body += await reader.readexactly(size)
            await reader.readexactly(2)
    return status, headers, await reader.readexactly(int(headers.get("content-length", "0")))


def _head(target: str, *extra: str, method: str = "GET") -> str:
    lines = [f"{method} {target} HTTP/1.1", "Host: ignored", *extra]
    return "\n".join(lines) + "\n"


async def test_request_is_forwarded_with_only_three_headers_and_streamed_back(
    proxy: Proxy, remote: FakeRemote
) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        return web.json_response(
            {"ok": True}, headers={"X-Custom": "kept", "Connection": "X-Drop", "X-Drop": "1",
                                   "Keep-Alive": "timeout=5"},
        )  # fmt: skip

    remote.handler = handler
    body = json.dumps({"a": 1}).encode()
    status, headers, answer = await _request(proxy.port, _head(
        f"matrix-federation://{remote.name}/_matrix/federation/v1/query/profile?user_id=%40u%3Ax",
        f"Proxy-Authorization: Bearer {SECRET}", "Authorization: X-Matrix origin=o,key=k,sig=s",
        "User-Agent: Synapse/1.163.2", "Content-Type: application/json", "Cookie: no",
        "X-Forwarded-For: 10.0.0.1", f"Content-Length: {len(body)}", method="PUT",
    ), body)  # fmt: skip
    assert status == 200 and json.loads(answer) == {"ok": True}
    assert headers["x-custom"] == "kept"
    assert "x-drop" not in headers and "keep-alive" not in headers
    request, received = remote.requests[0]
    assert received == body and request.method == "PUT"
    assert request.headers["Content-Length"] == str(len(body))
    assert request.raw_path == "/_matrix/federation/v1/query/profile?user_id=%40u%3Ax"
    assert request.headers["Host"] == remote.name
    assert request.headers["Authorization"] == "X-Matrix origin=o,key=k,sig=s"
    assert request.headers["User-Agent"] == "Synapse/1.163.2"
    assert "Cookie" not in request.headers and "X-Forwarded-For" not in request.headers
    assert "Proxy-Authorization" not in request.headers
    assert proxy.count("PUT", "200") == 1


@pytest.mark.parametrize(
    ("auth", "errcode"),
    [
        ([], "M_MISSING_TOKEN"),
        ([f"Proxy-Authorization: Bearer {SECRET}", f"Proxy-Authorization: Bearer {SECRET}"],
         "M_UNAUTHORIZED"),
        (["Proxy-Authorization: Bearer wrong"], "M_UNAUTHORIZED"),
        ([f"Proxy-Authorization: Basic {SECRET}"], "M_UNAUTHORIZED"),
    ],
)
async def test_missing_repeated_or_wrong_secret_is_401_and_nothing_is_forwarded(
    proxy: Proxy, remote: FakeRemote, auth: list[str], errcode: str
) -> None:
    status, _, body = await _request(
        proxy.port, _head(f"matrix-federation://{remote.name}/_matrix/key/v2/server", *auth)
    )
    assert status == 401
    assert json.loads(body)["errcode"] == errcode
    assert remote.requests == []
    assert proxy.count("GET", "401") == 1


async def test_other_targets_are_404_and_health_answers(proxy: Proxy) -> None:
    status, _, body = await _request(proxy.port, _head("/_matrix/federation/v1/version"))
    assert status == 404 and json.loads(body)["errcode"] == "M_UNRECOGNIZED"
    status, _, body = await _request(proxy.port, _head("/health"))
    assert (status, body) == (200, b"OK")


async def test_slow_remote_within_the_timeout_is_waited_for_beyond_it_is_502(
    proxy: Proxy, remote: FakeRemote, caplog: pytest.LogCaptureFixture
) -> None:
    release = asyncio.Event()

    async def handler(request: web.Request) -> web.StreamResponse:
        if request.path.endswith("/slow"):
            await release.wait()
        return web.json_response({"late": True})

    remote.handler = handler
    auth = f"Proxy-Authorization: Bearer {SECRET}"
    # Answers once the proxy has been waiting (its timeout is 1 s in this fixture).
    loop = asyncio.get_running_loop()
    loop.call_later(0.5, release.set)
    status, _, body = await _request(
        proxy.port, _head(f"matrix-federation://{remote.name}/_matrix/x/slow", auth)
    )
    assert status == 200 and json.loads(body) == {"late": True}
    release.clear()
    with caplog.at_level(logging.INFO, "federation_sender.outbound_proxy.access"):
        status, _, body = await _request(
            proxy.port, _head(f"matrix-federation://{remote.name}/_matrix/x/slow", auth)
        )
    release.set()
    assert status == 502
    assert json.loads(body)["errcode"] == "M_UNKNOWN" and "timed out" in json.loads(body)["err"]
    assert proxy.count("GET", "error") == 1
    assert any("/_matrix/x/slow -> failed (timed out)" in r.getMessage() for r in caplog.records)


async def test_large_body_streams_through_without_being_held_whole(
    proxy: Proxy, remote: FakeRemote
) -> None:
    """The remote sends 1 MiB, then waits until the caller has read that 1 MiB through the
    proxy before sending the other 15: a proxy that held the body whole would never pass
    the first part on, and the test would time out."""
    first_read = asyncio.Event()
    part = b"x" * (1024 * 1024)

    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        await response.write(part)
        await asyncio.wait_for(first_read.wait(), 10)
        for _ in range(15):
            await response.write(part)
        await response.write_eof()
        return response

    remote.handler = handler
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    writer.write(_head(f"matrix-federation://{remote.name}/_matrix/media/v3/download/x/y",
                       f"Proxy-Authorization: Bearer {SECRET}", "Connection: close")
                 .replace("\n", "\r\n").encode() + b"\r\n")  # fmt: skip
    head = await reader.readuntil(b"\r\n\r\n")
    assert b" 200 " in head and b"transfer-encoding: chunked" in head.lower()
    received = 0
    largest = 0
    while True:
        size = int((await reader.readuntil(b"\r\n")).strip(), 16)
        if not size:
            break
        largest = max(largest, size)
        received += len(await reader.readexactly(size))
        await reader.readexactly(2)
        if received >= len(part):
            first_read.set()
    writer.close()
    assert received == 16 * len(part)
    assert largest <= 64 * 1024  # passed on in chunks of at most 64 KiB
    assert proxy.registry.get_sample_value(BYTES_METRIC + "_total") == 16 * len(part)


@pytest.mark.parametrize("by_name", [False, True])
async def test_refused_address_is_502_and_not_contacted(
    certs: CertFiles, our_key: SigningKey, remote: FakeRemote, by_name: bool,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``by_name``: the destination is a name that resolves to the refused address
    (``localhost``); its 502 and log line said ``Cannot connect to host localhost:…
    ssl:<ssl.SSLContext object at 0x…> [None]`` (issue #42.6), where an IP literal's
    said why."""
    destination = f"localhost:{remote.port}" if by_name else remote.name
    async with make_client(certs, our_key, ip_allow_list=()) as client:
        server = OutboundProxyServer(client, secret=SECRET, clock=SystemClock(),
                                     location=ProxyLocation(host="127.0.0.1", port=0))
        await server.start()
        try:
            assert server.port is not None
            status, _, body = await _request(server.port, _head(
                f"matrix-federation://{destination}/_matrix/key/v2/server",
                f"Proxy-Authorization: Bearer {SECRET}"))  # fmt: skip
        finally:
            await server.close()
    error = json.loads(body)["err"]
    assert status == 502 and "refused by the outbound policy" in error, error
    assert "SSLContext" not in error and "SSLContext" not in caplog.text
    assert remote.requests == []


async def test_unix_socket_location(proxy: Proxy, remote: FakeRemote, tmp_path: object) -> None:
    from pathlib import Path

    path = Path(str(tmp_path)) / "fed1.sock"
    server = OutboundProxyServer(proxy.client, secret=SECRET, clock=SystemClock(),
                                 location=ProxyLocation(path=str(path)))
    await server.start()
    try:
        reader, writer = await asyncio.open_unix_connection(str(path))
        writer.write(_head(f"matrix-federation://{remote.name}/_matrix/key/v2/server",
                           f"Proxy-Authorization: Bearer {SECRET}")
                     .replace("\n", "\r\n").encode() + b"\r\n")  # fmt: skip
        status, _, body = await _read_response(reader)
        writer.close()
    finally:
        await server.close()
    assert status == 200 and json.loads(body) == {"pdus": {}}
    assert not path.exists()


async def test_keep_alive_serves_several_requests_and_an_idle_connection_is_closed(
    proxy: Proxy, remote: FakeRemote
) -> None:
    server = OutboundProxyServer(proxy.client, secret=SECRET, clock=SystemClock(),
                                 location=ProxyLocation(host="127.0.0.1", port=0),
                                 idle_timeout_s=0.3)
    await server.start()
    try:
        assert server.port is not None
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        for _ in range(2):
            writer.write(_head(f"matrix-federation://{remote.name}/_matrix/key/v2/server",
                               f"Proxy-Authorization: Bearer {SECRET}")
                         .replace("\n", "\r\n").encode() + b"\r\n")  # fmt: skip
            status, _, _ = await _read_response(reader)
            assert status == 200
        # Then nothing: the proxy closes the connection once it has been idle 0.3 s.
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
    finally:
        await server.close()
    assert len(remote.requests) == 2


async def test_many_concurrent_requests_to_one_server_are_not_held_to_the_send_pool(
    proxy: Proxy, remote: FakeRemote
) -> None:
    """Six slow requests to one server are all at the remote at once (``/send``'s pool
    allows 4 per host; a long download must not hold up a join)."""
    release = asyncio.Event()
    in_progress = 0
    all_in = asyncio.Event()

    async def handler(request: web.Request) -> web.StreamResponse:
        nonlocal in_progress
        in_progress += 1
        if in_progress == 6:
            all_in.set()
        await release.wait()
        return web.json_response({})

    remote.handler = handler
    target = f"matrix-federation://{remote.name}/_matrix/federation/v1/event/x"
    requests = [asyncio.create_task(_request(proxy.port, _head(
        target, f"Proxy-Authorization: Bearer {SECRET}"))) for _ in range(6)]  # fmt: skip
    try:
        await asyncio.wait_for(all_in.wait(), 5)
    finally:
        release.set()
    assert [status for status, _, _ in await asyncio.gather(*requests)] == [200] * 6


async def test_a_path_that_looks_like_another_host_stays_a_path(
    proxy: Proxy, remote: FakeRemote
) -> None:
    status, _, _ = await _request(proxy.port, _head(
        f"matrix-federation://{remote.name}//elsewhere.example/_matrix/x?a=%2F",
        f"Proxy-Authorization: Bearer {SECRET}"))  # fmt: skip
    assert status == 200
    assert remote.requests[0][0].raw_path == "//elsewhere.example/_matrix/x?a=%2F"
