"""The built-in HTTP/1.1 client (transport/h1.py) through the federation client, over TLS
to a raw loopback server that writes exactly the bytes each case needs: keep-alive
reuse, framing (chunked, length, to the end of the connection), informational heads,
stale and closing connections, malformed framing, limits and idle expiry.

Hostile bodies, headers and TLS failures common to both HTTP clients are in
``test_client.py`` and ``tests/reliability/test_rel_hostile.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp.resolver import DefaultResolver

from federation_sender.testing.certs import CertFiles
from federation_sender.testing.loopback import loopback_server
from federation_sender.testing.waiting import wait_until
from federation_sender.transport.addresses import AddressFilter, FilteringResolver
from federation_sender.transport.client import FederationClient
from federation_sender.transport.h1 import Http1Pool, request_head
from federation_sender.transport.result import Outcome
from federation_sender.transport.signing import SigningKey

from .conftest import RawRemote, make_client, start_remote
from .test_client import txn

OK_JSON = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"


async def read_request(reader: asyncio.StreamReader) -> bytes:
    """One request (head and body); b"" if the client closed the connection first."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return b""
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head + await reader.readexactly(length)


def serve_each(
    answer: Callable[[int, int], bytes], close_after: Callable[[int, int], bool] | None = None
) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]:
    """A handler answering request ``i`` on connection ``c`` with ``answer(c, i)`` until
    the client hangs up (or ``close_after(c, i)``)."""
    connections = 0

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        nonlocal connections
        c = connections
        connections += 1
        i = 0
        while await read_request(r):
            w.write(answer(c, i))
            await w.drain()
            if close_after is not None and close_after(c, i):
                return
            i += 1

    return handler


def json_ok(body: bytes = b"{}") -> bytes:
    return OK_JSON + b"Content-Length: %d\r\n\r\n%s" % (len(body), body)


async def send_n(client: FederationClient, dest: str, n: int) -> list[Outcome]:
    return [(await client.send_transaction(txn(dest, f"t{i}"))).outcome for i in range(n)]


async def test_keep_alive_carries_every_request_on_one_connection(
    certs: CertFiles, our_key: SigningKey, raw_remote: RawRemote
) -> None:
    raw_remote.handler = serve_each(lambda _c, _i: json_ok())
    async with make_client(certs, our_key) as client:
        assert await send_n(client, raw_remote.name, 5) == [Outcome.SUCCESS] * 5
    assert raw_remote.connections == 1


@pytest.mark.parametrize(
    ("response", "reused"),
    [
        # chunked, with an extension, a trailer, and a chunk split in two
        (OK_JSON + b"Transfer-Encoding: chunked\r\n\r\n"
         b"1;ext=1\r\n{\r\n3\r\n\"a\"\r\n2\r\n:1\r\n1\r\n}\r\n0\r\nX-T: y\r\n\r\n", True),
        (OK_JSON + b"Content-Length: 7\r\n\r\n{\"a\":1}", True),
        # informational heads before the real one
        (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: x\r\n\r\n"
         + json_ok(b"{\"a\":1}"), True),
        # the server closes: not reused
        (OK_JSON + b"Connection: close\r\nContent-Length: 7\r\n\r\n{\"a\":1}", False),
        (b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\nContent-Length: 7\r\n\r\n"
         b"{\"a\":1}", False),
    ],
)
async def test_framings_are_read_and_only_reusable_connections_are_reused(
    certs: CertFiles, our_key: SigningKey, raw_remote: RawRemote, response: bytes, reused: bool
) -> None:
    raw_remote.handler = serve_each(lambda _c, _i: response)
    async with make_client(certs, our_key) as client:
        assert await send_n(client, raw_remote.name, 3) == [Outcome.SUCCESS] * 3
    assert raw_remote.connections == (1 if reused else 3)


async def test_a_body_to_the_end_of_the_connection_is_read(
    certs: CertFiles, our_key: SigningKey, raw_remote: RawRemote
) -> None:
    raw_remote.handler = serve_each(lambda _c, _i: OK_JSON + b"\r\n{\"pdus\": {}}",
                                    close_after=lambda _c, _i: True)
    async with make_client(certs, our_key) as client:
        assert await send_n(client, raw_remote.name, 2) == [Outcome.SUCCESS] * 2
    assert raw_remote.connections == 2


async def test_a_connection_the_server_closed_while_idle_is_replaced_not_failed(
    certs: CertFiles, our_key: SigningKey, raw_remote: RawRemote
) -> None:
    # Each connection answers one request, keeps the connection open as if reusable,
    # then drops it when the next request arrives: the client must retry that request
    # once on a new connection (the same transaction id: idempotent).
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(json_ok())
        await w.drain()
        await read_request(r)
        w.transport.abort()

    raw_remote.handler = handler
    async with make_client(certs, our_key) as client:
        assert await send_n(client, raw_remote.name, 3) == [Outcome.SUCCESS] * 3
    assert raw_remote.connections == 3  # requests 2 and 3 each tried twice


async def test_a_connection_broken_mid_response_is_not_retried(
    certs: CertFiles, our_key: SigningKey, raw_remote: RawRemote
) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(OK_JSON + b"Content-Length: 100\r\n\r\n{\"pdus\"")
        await w.drain()
        w.transport.abort()

    raw_remote.handler = handler
    async with make_client(certs, our_key) as client:
        result = await client.send_transaction(txn(raw_remote.name))
    assert result.outcome is Outcome.TRANSIENT
    assert result.error == "connection broken while reading the response"
    assert raw_remote.connections == 1


@pytest.mark.parametrize(
    ("response", "expect"),
    [
        (OK_JSON + b"Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}", "conflicting"),
        (OK_JSON + b"Content-Length: -2\r\n\r\n{}", "malformed Content-Length"),
        (OK_JSON + b"Transfer-Encoding: gzip\r\n\r\n{}", "unsupported Transfer-Encoding"),
        (OK_JSON + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n", "chunk size"),
        (OK_JSON + b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}XX0\r\n\r\n", "malformed chunk"),
        (OK_JSON + b"Transfer-Encoding: chunked\r\n\r\n" + b"1" * 2000, "chunk line"),
        (OK_JSON + b" Folded: header\r\nContent-Length: 2\r\n\r\n{}", "malformed header"),
        (b"HTTP/1.1 101 Switching Protocols\r\n\r\n", "101"),
        (b"HTTP/2 200\r\n\r\n", "status line"),
        (b"HTTP/1.1 2000 OK\r\n\r\n", "status line"),
        (OK_JSON + b"".join(b"X-%d: v\r\n" % i for i in range(200)) + b"\r\n", "headers"),
    ],
)
async def test_malformed_framing_is_an_invalid_response(
    certs: CertFiles, our_key: SigningKey, raw_remote: RawRemote, response: bytes, expect: str
) -> None:
    raw_remote.handler = serve_each(lambda _c, _i: response)
    async with make_client(certs, our_key, attempt_timeout_s=2.0) as client:
        result = await client.send_transaction(txn(raw_remote.name))
    assert result.outcome is Outcome.TRANSIENT, result
    assert result.error.startswith("invalid HTTP response"), result
    assert expect in result.error, result


async def test_many_small_chunks_are_held_to_the_response_limit(
    certs: CertFiles, our_key: SigningKey, raw_remote: RawRemote
) -> None:
    chunks = b"1\r\n \r\n" * 5000  # 5,000 bytes of body in 30,000 bytes of framing
    raw_remote.handler = serve_each(
        lambda _c, _i: OK_JSON + b"Transfer-Encoding: chunked\r\n\r\n" + chunks + b"0\r\n\r\n")
    async with make_client(certs, our_key, max_response_bytes=4096) as client:
        result = await client.send_transaction(txn(raw_remote.name))
    assert result.outcome is Outcome.TRANSIENT
    assert "exceeds the 4096 byte limit" in result.error


@contextlib.asynccontextmanager
async def loopback_pool(**overrides: float) -> AsyncIterator[Http1Pool]:
    address_filter = AddressFilter(["127.0.0.0/8"])
    settings = {"connect_timeout_s": 2.0, "max_connections": 10, "max_per_host": 2,
                "max_response_bytes": 65536, **overrides}
    pool = Http1Pool(address_filter=address_filter,
                     resolver=FilteringResolver(DefaultResolver(), address_filter),
                     ssl_context=None, **settings)  # type: ignore[arg-type]
    try:
        yield pool
    finally:
        await pool.close()


def head(length: int) -> bytes:
    return request_head("/_matrix/federation/v1/send/t", "remote.test", "X-Matrix x", "t",
                        length)


async def test_idle_connections_close_after_the_keepalive() -> None:
    ok = serve_each(lambda _c, _i: json_ok())
    async with loopback_server(ok) as port, loopback_pool(keepalive_s=0.3) as pool:
        responses = await asyncio.gather(*(pool.put("127.0.0.1", port, None, head(2), b"{}")
                                           for _ in range(2)))
        assert [r.status for r in responses] == [200, 200]
        assert pool.idle_connections == 2
        await wait_until(lambda: pool.idle_connections, "the keep-alive expiry",
                         accept=lambda n: n == 0, timeout_s=5)


async def test_a_connection_idle_for_30_s_is_kept_by_default() -> None:
    """A 10,000-server room cycles through its destinations in tens of seconds under
    load: with aiohttp's 15 s, every transaction found its connection closed and opened
    a new one (126,731 connections for 10,000 destinations, bench/big_room.py). Idle
    connections are kept 60 s by default (Synapse's federation pool: 120 s)."""
    ok = serve_each(lambda _c, _i: json_ok())
    async with loopback_server(ok) as port, loopback_pool() as pool:
        assert (await pool.put("127.0.0.1", port, None, head(2), b"{}")).status == 200
        (conn,) = [c for p in pool._pools.values() for c in p.idle]
        conn.idle_since -= 30.0
        pool._sweep()
        assert pool.idle_connections == 1
        conn.idle_since -= 31.0
        pool._sweep()
        assert pool.idle_connections == 0


async def test_bytes_nobody_asked_for_take_an_idle_connection_out_of_the_pool() -> None:
    parked, sent_extra = asyncio.Event(), asyncio.Event()

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(json_ok())
        await w.drain()
        await parked.wait()  # the extra bytes reach a connection at rest in the pool
        w.write(b"HTTP/1.1 200 OK\r\n")
        await w.drain()
        sent_extra.set()
        await read_request(r)

    async with loopback_server(handler) as port, loopback_pool() as pool:
        assert (await pool.put("127.0.0.1", port, None, head(2), b"{}")).status == 200
        assert pool.idle_connections == 1  # put() parks the connection before it returns
        parked.set()
        await asyncio.wait_for(sent_extra.wait(), 5.0)
        await wait_until(lambda: pool.idle_connections, "the connection dropped",
                         accept=lambda n: n == 0, timeout_s=5)


async def test_requests_over_the_per_host_limit_wait_and_a_cancelled_waiter_frees_nothing(
) -> None:
    active = peak = 0
    release = asyncio.Event()

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        nonlocal active, peak
        while await read_request(r):
            active += 1
            peak = max(peak, active)
            await release.wait()
            active -= 1
            w.write(json_ok())
            await w.drain()

    async with loopback_server(handler) as port, loopback_pool(max_per_host=2) as pool:
        puts = [asyncio.create_task(pool.put("127.0.0.1", port, None, head(2), b"{}"))
                for _ in range(5)]
        await wait_until(lambda: active, "both connections busy", accept=lambda n: n == 2,
                         timeout_s=5)
        puts[4].cancel()  # a waiter given up: it must not take or leak a slot
        release.set()
        results = await asyncio.gather(*puts, return_exceptions=True)
        assert [getattr(r, "status", None) for r in results[:4]] == [200] * 4
        assert isinstance(results[4], asyncio.CancelledError)
        assert peak == 2
        assert pool.idle_connections == 2
        assert (await pool.put("127.0.0.1", port, None, head(2), b"{}")).status == 200


async def test_a_request_cancelled_while_waiting_for_the_total_limit_leaves_no_pool(
) -> None:
    release = asyncio.Event()

    async def slow(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while await read_request(r):
            await release.wait()
            w.write(json_ok())
            await w.drain()

    async with (
        loopback_server(slow) as port_a,
        loopback_server(slow) as port_b,
        loopback_pool(max_connections=1) as pool,
    ):
        first = asyncio.create_task(pool.put("127.0.0.1", port_a, None, head(2), b"{}"))
        await wait_until(lambda: pool.pool_keys, "the first request under way",
                         accept=lambda n: n == 1, timeout_s=5)
        waiting = asyncio.create_task(pool.put("127.0.0.1", port_b, None, head(2), b"{}"))
        await wait_until(lambda: pool.pool_keys, "the second request waiting",
                         accept=lambda n: n == 2, timeout_s=5)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert pool.pool_keys == 1  # B's pool went with its only request
        release.set()
        assert (await first).status == 200
        assert (await pool.put("127.0.0.1", port_b, None, head(2), b"{}")).status == 200
        assert pool.pool_keys == 2 and pool.idle_connections == 2


def test_a_line_break_in_a_header_value_is_refused() -> None:
    with pytest.raises(ValueError, match="line break"):
        request_head("/p", "evil.test\r\nX-Injected: 1", "X-Matrix x", "t", 2)


def test_the_client_sends_on_uvloop_over_tls_and_plain_http(
    certs: CertFiles, our_key: SigningKey
) -> None:
    """``--event-loop uvloop`` (or ``auto`` with uvloop installed): uvloop's transports
    are not subclasses of ``asyncio.Transport``, and the built-in client once refused
    them, so every request failed as a disconnection and nothing was ever delivered."""
    uvloop = pytest.importorskip("uvloop")

    async def scenario() -> None:
        assert type(asyncio.get_running_loop()).__module__.startswith("uvloop")
        remote, site = await start_remote(certs)
        try:
            async with make_client(certs, our_key) as client:
                outcomes = await send_n(client, remote.name, 3)
        finally:
            await site.cleanup()
        assert outcomes == [Outcome.SUCCESS] * 3
        assert len(remote.requests) == 3
        ok = serve_each(lambda _c, _i: json_ok())
        async with loopback_server(ok) as port, loopback_pool() as pool:
            for _ in range(2):
                response = await pool.put("127.0.0.1", port, None, head(2), b"{}")
                assert response.status == 200
            assert pool.idle_connections == 1  # kept alive and reused

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(scenario())


async def test_a_tls_connection_holds_no_256_kib_read_buffer(
    certs: CertFiles, our_key: SigningKey, raw_remote: RawRemote
) -> None:
    """asyncio's TLS protocol allocates a 256 KiB read buffer per connection and keeps
    it for the connection's life (289 KB of RSS each: 2.8 GB for a 10,000-server room's
    keep-alive connections). The built-in client's connections use 16 KiB."""
    raw_remote.handler = serve_each(lambda _c, _i: json_ok())
    tracemalloc.start()
    try:
        async with make_client(certs, our_key) as client:
            assert await send_n(client, raw_remote.name, 1) == [Outcome.SUCCESS]
            snapshot = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    buffers = [t.size for t in snapshot.filter_traces(
        [tracemalloc.Filter(True, asyncio.sslproto.__file__)]).traces]
    # One connection: the test server's end (in this process, asyncio's own TLS)
    # holds a 256 KiB buffer, the client's end 16 KiB.
    assert len([b for b in buffers if b >= 256 * 1024]) == 1
    assert len([b for b in buffers if 16 * 1024 <= b < 32 * 1024]) == 1


async def test_a_reset_before_any_byte_of_the_response_is_a_disconnection_to_retry() -> None:
    """ECONNRESET before the response (our request met the RST of a connection the
    server had closed while it sat idle in our pool) is ``Disconnected(started=False)``,
    which the pool retries once on a new connection; it was the bare reset, a failure
    (a 3.12 run of the suite met it under load). After a byte of the response it stays
    the reset."""
    from federation_sender.transport.classify import Disconnected
    from federation_sender.transport.h1_exchange import Exchange

    accepted: list[asyncio.StreamWriter] = []  # held open, closed at the end
    server = await asyncio.start_server(lambda _r, w: accepted.append(w), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    loop = asyncio.get_running_loop()
    try:
        for answered, expected in ((b"", Disconnected), (b"HTTP/1.1 2", ConnectionResetError)):
            transport, ex = await loop.create_connection(lambda: Exchange(None, 1 << 16),
                                                         "127.0.0.1", port)
            task = asyncio.ensure_future(ex.request(b"PUT / HTTP/1.1\r\n\r\n"))
            await asyncio.sleep(0)  # one turn: the task writes and awaits the answer
            assert ex._waiter is not None
            if answered:
                ex.data_received(answered)
            ex.connection_lost(ConnectionResetError(104, "Connection reset by peer"))
            with pytest.raises(expected) as err:
                await task
            if expected is Disconnected:
                assert not err.value.started  # type: ignore[attr-defined]
            transport.close()
    finally:
        server.close()
        for w in accepted:
            w.close()
        await server.wait_closed()
