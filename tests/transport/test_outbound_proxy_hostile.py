"""The outbound federation proxy against callers that do not play by the rules (issue
#42): what a stranger without the token can make it spend, and what the framing refuses.

Real sockets on 127.0.0.1, the real :class:`OutboundProxyServer` over a real
:class:`FederationClient` (as ``test_outbound_proxy.py`` builds them), the caller's side
written by hand. The last test feeds the proxy's parser directly (sans-I/O), with
Hypothesis.
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from federation_sender.clock import SystemClock
from federation_sender.testing.certs import CertFiles
from federation_sender.transport.client import FederationClient
from federation_sender.transport.outbound_proxy import OutboundProxyServer, ProxyLocation
from federation_sender.transport.signing import SigningKey

from .conftest import LOOPBACK, ORIGIN, FakeRemote, make_client
from .test_outbound_proxy import SECRET, Proxy, _head, _read_response

ROOT = Path(__file__).resolve().parents[2]
AUTH = f"Proxy-Authorization: Bearer {SECRET}"
StartProxy = Callable[..., Awaitable[Proxy]]


@pytest.fixture
async def start_proxy(certs: CertFiles, our_key: SigningKey) -> AsyncIterator[StartProxy]:
    """Starts proxies over one client; a forward timeout far beyond any wait below, so
    that what cuts a caller off is the limit under test."""
    servers: list[OutboundProxyServer] = []
    async with make_client(certs, our_key, attempt_timeout_s=5.0) as client:

        async def start(**overrides: Any) -> Proxy:
            registry = CollectorRegistry()
            options: dict[str, Any] = {
                "secret": SECRET, "location": ProxyLocation(host="127.0.0.1", port=0),
                "clock": SystemClock(), "registry": registry, "forward_timeout_s": 30.0,
            }  # fmt: skip
            options.update(overrides)
            server = OutboundProxyServer(client, **options)
            await server.start()
            servers.append(server)
            return Proxy(server, client, registry)

        yield start
        for server in servers:
            await server.close()


def _wire(head: str) -> bytes:
    return head.replace("\n", "\r\n").encode() + b"\r\n"


async def _connect(proxy: Proxy) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", proxy.port)


async def _closed(reader: asyncio.StreamReader) -> bool:
    """Whether the proxy closed the connection (EOF or reset) within 5 s."""
    try:
        return await asyncio.wait_for(reader.read(), 5) == b""
    except ConnectionError:
        return True


async def test_chunk_size_minus_one_to_health_without_a_token_is_answered_before_the_body(
    start_proxy: StartProxy,
) -> None:
    """Chunk size -1 once made the proxy buffer all the caller sent, until it closed.
    Now ``/health`` is answered from the head, and the connection is closed while the
    caller is still sending: the caller gets at most its socket buffers and a small
    discard allowance through, never the 64 MiB it tries to send."""
    proxy = await start_proxy()
    reader, writer = await _connect(proxy)
    writer.write(_wire(_head("/health", "Transfer-Encoding: chunked")) + b"-1\r\n")
    limit = 64 * 1024 * 1024
    block = b"x" * (64 * 1024)
    sent = 0

    async def flood() -> None:
        nonlocal sent
        while sent < limit:
            writer.write(block)
            await writer.drain()
            sent += len(block)

    flooding = asyncio.create_task(flood())
    try:
        status, headers, body = await asyncio.wait_for(_read_response(reader), 10)
        assert (status, body) == (200, b"OK")
        assert headers["connection"] == "close"
        with pytest.raises(ConnectionError):
            await asyncio.wait_for(flooding, 20)
    finally:
        flooding.cancel()
        writer.close()
    assert sent < limit // 2


@pytest.mark.parametrize("size", [b"0x2", b"+2", b"0_2", b" 2", b"2 ", b"2\t", b"-1", b"2;"])
async def test_chunk_sizes_outside_the_grammar_are_400_and_close(
    start_proxy: StartProxy, remote: FakeRemote, size: bytes
) -> None:
    proxy = await start_proxy()
    reader, writer = await _connect(proxy)
    writer.write(_wire(_head(f"matrix-federation://{remote.name}/_matrix/x", AUTH,
                             "Transfer-Encoding: chunked", method="PUT"))
                 + size + b"\r\nab\r\n0\r\n\r\n")  # fmt: skip
    try:
        status, headers, _ = await asyncio.wait_for(_read_response(reader), 10)
        assert status == 400 and headers["connection"] == "close"
        assert await _closed(reader)
    finally:
        writer.close()
    assert all(body != b"ab" for _, body in remote.requests)


@pytest.mark.parametrize("size", [b"2", b"02", b"2;name", b'2 ; a = "q \\" x" ;b=t'])
async def test_chunk_sizes_within_the_grammar_are_forwarded(
    start_proxy: StartProxy, remote: FakeRemote, size: bytes
) -> None:
    proxy = await start_proxy()
    reader, writer = await _connect(proxy)
    writer.write(_wire(_head(f"matrix-federation://{remote.name}/_matrix/x", AUTH,
                             "Transfer-Encoding: chunked", method="PUT"))
                 + size + b"\r\nab\r\n1;x=y\r\nc\r\n0\r\nX-Trailer: t\r\n\r\n")  # fmt: skip
    try:
        status, _, _ = await asyncio.wait_for(_read_response(reader), 10)
    finally:
        writer.close()
    assert status == 200
    assert remote.requests[0][1] == b"abc"


@pytest.mark.parametrize(
    ("target", "auth", "status"),
    [
        ("matrix-federation://{remote}/_matrix/x", [], 401),
        ("matrix-federation://{remote}/_matrix/x", ["Proxy-Authorization: Bearer wrong"], 401),
        ("/_matrix/federation/v1/version", [], 404),
        ("/health", [], 200),
    ],
)
async def test_answers_from_the_head_never_wait_for_the_announced_body(
    start_proxy: StartProxy, remote: FakeRemote, target: str, auth: list[str], status: int
) -> None:
    """A gigabyte announced and not one byte of it sent: the answer comes at once, with
    ``Connection: close``, and the connection is closed."""
    proxy = await start_proxy()
    reader, writer = await _connect(proxy)
    writer.write(_wire(_head(target.format(remote=remote.name), *auth,
                             "Content-Length: 1000000000", method="GET")))  # fmt: skip
    try:
        got, headers, _ = await asyncio.wait_for(_read_response(reader), 5)
        assert got == status and headers["connection"] == "close"
        assert await _closed(reader)
    finally:
        writer.close()
    assert remote.requests == []
    assert proxy.count("GET", "401") == (1 if status == 401 else 0)


@pytest.mark.parametrize(
    ("interval_s", "message"),
    [(None, "no request body bytes for 0.5 s"), (0.05, "not received within 1.5 s")],
    ids=["stalled", "dripping"],
)
async def test_a_slow_forwarded_body_is_cut_at_its_deadline(
    start_proxy: StartProxy, remote: FakeRemote, interval_s: float | None, message: str
) -> None:
    """One byte then nothing (each read's deadline), or one byte every 50 ms (the whole
    body's deadline): 408 long before the 30 s the remote would be waited for."""
    proxy = await start_proxy(body_read_timeout_s=0.5, body_timeout_s=1.5)
    reader, writer = await _connect(proxy)
    writer.write(_wire(_head(f"matrix-federation://{remote.name}/_matrix/x", AUTH,
                             "Content-Length: 1000", method="PUT")) + b"{")  # fmt: skip

    async def drip() -> None:
        while interval_s is not None:
            await asyncio.sleep(interval_s)
            writer.write(b" ")
            await writer.drain()

    dripping = asyncio.create_task(drip())
    loop = asyncio.get_running_loop()
    started = loop.time()
    try:
        status, headers, body = await asyncio.wait_for(_read_response(reader), 10)
        elapsed = loop.time() - started
        assert status == 408 and headers["connection"] == "close"
        assert message in body.decode()
        assert elapsed < 5
        assert await _closed(reader)
    finally:
        dripping.cancel()
        writer.close()
    assert proxy.count("PUT", "408") == 1


async def test_the_connection_cap_refuses_one_more_at_once_and_serves_those_it_holds(
    start_proxy: StartProxy, remote: FakeRemote
) -> None:
    """Cap 4: a caller's kept-alive connection and three idle ones fill it. A fifth is
    answered 503 and closed at once, while the kept-alive one still forwards and answers
    ``/health``; once an idle one leaves, a new connection is served."""
    proxy = await start_proxy(max_connections=4)
    held = [await _connect(proxy) for _ in range(4)]
    for reader, writer in held:
        writer.write(_wire(_head("/health")))
        assert (await _read_response(reader))[0] == 200  # accepted and counted
    assert proxy.server.open_connections == 4

    loop = asyncio.get_running_loop()
    started = loop.time()
    reader, writer = await _connect(proxy)
    status, headers, _ = await asyncio.wait_for(_read_response(reader), 5)
    assert status == 503 and headers["connection"] == "close"
    assert await _closed(reader)
    assert loop.time() - started < 1.0
    writer.close()
    refused = proxy.registry.get_sample_value(
        "federation_sender_outbound_proxy_refused_connections_total")
    assert refused == 1

    reader, writer = held[0]
    writer.write(_wire(_head(f"matrix-federation://{remote.name}/_matrix/key/v2/server", AUTH)))
    assert (await asyncio.wait_for(_read_response(reader), 10))[0] == 200
    writer.write(_wire(_head("/health")))
    status, _, body = await asyncio.wait_for(_read_response(reader), 5)
    assert (status, body) == (200, b"OK")

    # One leaves: the proxy closes it after the answer, and has let go of it by the time
    # the caller sees the end (the abort and the task's end are one turn of the loop).
    reader, writer = held.pop(1)
    writer.write(_wire(_head("/health", "Connection: close")))
    assert (await _read_response(reader))[0] == 200
    assert await _closed(reader)
    writer.close()
    assert proxy.server.open_connections == 3
    reader, writer = await _connect(proxy)
    writer.write(_wire(_head("/health")))
    assert (await asyncio.wait_for(_read_response(reader), 5))[0] == 200
    writer.close()
    for _, w in held:
        w.close()


@pytest.mark.parametrize(
    "extra",
    [
        ["Content-Length: 2", "Transfer-Encoding: chunked"],
        ["Content-Length: 2", "Content-Length: 3"],
        ["X-Folded: a", " b"],
        ["Transfer-Encoding: gzip"],
        ["Content-Length: +2"],
    ],
    ids=["cl-and-te", "two-lengths", "obs-fold", "other-coding", "signed-length"],
)
async def test_ambiguous_framing_is_400(
    start_proxy: StartProxy, remote: FakeRemote, extra: list[str]
) -> None:
    proxy = await start_proxy()
    reader, writer = await _connect(proxy)
    writer.write(_wire(_head(f"matrix-federation://{remote.name}/_matrix/x", AUTH, *extra,
                             method="PUT")) + b"2\r\nab\r\n0\r\n\r\n")  # fmt: skip
    try:
        status, _, _ = await asyncio.wait_for(_read_response(reader), 5)
    finally:
        writer.close()
    assert status == 400
    assert remote.requests == []


async def test_bare_lf_in_a_head_is_400(start_proxy: StartProxy) -> None:
    proxy = await start_proxy()
    reader, writer = await _connect(proxy)
    writer.write(b"GET /health HTTP/1.1\r\nHost: x\nX-Hidden: y\r\n\r\n")
    try:
        status, _, _ = await asyncio.wait_for(_read_response(reader), 5)
    finally:
        writer.close()
    assert status == 400


# --- out of file descriptors --------------------------------------------------------

CHILD_FD_LIMIT = 256


def out_of_descriptors_child() -> None:
    """A proxy (default cap) in a process of 256 descriptors that then takes them all, as
    a worker whose own sockets used them up would: what does its log say meanwhile?
    Prints its port, frees the descriptors at ``release`` on stdin, stops at ``exit``."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (CHILD_FD_LIMIT, hard))
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(levelname)s %(name)s %(message)s")
    asyncio.run(_child(sys.argv[1]))


async def _child(ca_file: str) -> None:
    client = FederationClient(server_name=ORIGIN, signing_key=SigningKey.generate("a_child"),
                              clock=SystemClock(), tls_extra_ca_file=ca_file,
                              ip_allow_list=LOOPBACK)  # fmt: skip
    loop = asyncio.get_running_loop()
    async with client:
        server = OutboundProxyServer(client, secret=SECRET, clock=SystemClock(),
                                     location=ProxyLocation(host="127.0.0.1", port=0))
        await server.start()
        commands = asyncio.StreamReader()  # before the descriptors run out
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(commands), sys.stdin)
        filler: list[int] = []
        try:
            while True:
                filler.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            pass
        print(server.port, flush=True)
        while (line := (await commands.readline()).strip()) not in (b"exit", b""):
            if line == b"release":
                for fd in filler:
                    os.close(fd)
                filler = []
        await server.close()


async def test_out_of_descriptors_the_listener_pauses_instead_of_flooding_the_log(
    certs: CertFiles,
) -> None:
    """asyncio's own accept handler logs ``socket.accept() out of system resource`` for
    every pending connection on every turn of the loop (36,389 lines in 44 s, measured).
    Ours logs one line when it stops accepting and one when it starts again, and the
    callers that waited in the backlog are served once descriptors are free."""
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c",
        "from tests.transport.test_outbound_proxy_hostile import out_of_descriptors_child;"
        " out_of_descriptors_child()", str(certs.ca_cert),
        cwd=ROOT, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert child.stdin is not None and child.stdout is not None and child.stderr is not None
    stderr = asyncio.create_task(child.stderr.read())
    try:
        port = int(await asyncio.wait_for(child.stdout.readline(), 30))
        callers = [await asyncio.open_connection("127.0.0.1", port) for _ in range(20)]
        for _, writer in callers:
            writer.write(_wire(_head("/health")))
        # The window in which asyncio's handler floods (the callers wait in the backlog).
        await asyncio.sleep(1.5)
        child.stdin.write(b"release\n")
        answers = await asyncio.wait_for(
            asyncio.gather(*(_read_response(reader) for reader, _ in callers)), 15)
        assert [status for status, _, _ in answers] == [200] * len(callers)
        for _, writer in callers:
            writer.close()
        child.stdin.write(b"exit\n")
        await asyncio.wait_for(child.wait(), 15)
    finally:
        if child.returncode is None:
            child.kill()
            await child.wait()
    log = (await stderr).decode()
    floods = log.count("out of system resource") + log.count("cannot accept connections")
    assert 1 <= floods <= 2, log[-2000:]


# --- the parser, fed directly ---------------------------------------------------------

MAX_HEAD = 512
MAX_LINE = 64
MAX_TRAILERS = 128


_SIZES = [b"0x2", b"+2", b"-1", b" 2", b"2 ", b"0_2", b"2;", b"f" * 17, b"", b"g",
          b"2\r", b"2\n", b"2;a\rb", b"2;a\nb", b"2;a=\"b"]
_LENGTHS = ["+2", "-1", "2, 3", "0x2", " ", "1" * 20, "99999"]


@st.composite
def _requests(draw: st.DrawFn, hostile: bool = False
              ) -> tuple[bytes, list[tuple[str, bytes]]]:
    """One to three pipelined requests and what each should parse to: valid ones, or
    (``hostile``) some with chunk sizes and lengths drawn from the refused forms."""

    def size_text(n: int) -> bytes:
        if hostile and draw(st.integers(0, 3)) == 0:
            return draw(st.sampled_from(_SIZES) | st.from_regex(rb"\A[0-9a-fA-F]{1,20}\Z"))
        return b"%x" % n

    wire = b""
    expected: list[tuple[str, bytes]] = []
    for _ in range(draw(st.integers(1, 3))):
        method = draw(st.sampled_from(["GET", "PUT", "POST"]))
        target = draw(st.sampled_from(
            ["/health", "matrix-federation://remote.example:8448/_matrix/x?a=%2F"]))
        lines = [f"{method} {target} HTTP/1.1", "Host: h"]
        lines += [f"X-{i}: {'v' * draw(st.integers(0, 60))}"
                  for i in range(draw(st.integers(0, 4)))]
        body = draw(st.binary(max_size=300))
        framing = draw(st.sampled_from(["length", "chunked", "none"]))
        if framing == "none":
            body = b""
        framed = body
        if framing == "length":
            length = str(len(body))
            if hostile and draw(st.integers(0, 3)) == 0:
                length = draw(st.sampled_from(_LENGTHS))
            lines.append(f"Content-Length: {length}")
        elif framing == "chunked":
            lines.append("Transfer-Encoding: chunked")
            framed = b""
            rest = body
            while rest:
                n = draw(st.integers(1, len(rest)))
                ext = draw(st.sampled_from([b"", b";a", b";a=b", b' ;q="x y"']))
                framed += b"%b%b\r\n%b\r\n" % (size_text(n), ext, rest[:n])
                rest = rest[n:]
            framed += size_text(0) + b"\r\n" + draw(st.sampled_from([b"", b"T: v\r\n"])) + b"\r\n"
        wire += ("\r\n".join(lines) + "\r\n\r\n").encode() + framed
        expected.append((target, body))
    return wire, expected


_INSERTS = [b"\r", b"\n", b" ", b"\t", b"\x00", b"\r\n", b"\r\n\r\n", b"0\r\n", b"-1",
            b"0x", b"+", b"_", b";", b"Content-Length: 5\r\n",
            b"Transfer-Encoding: chunked\r\n", b"x" * 600, b"f" * 17]


@st.composite
def _mutated(draw: st.DrawFn) -> tuple[bytes, list[tuple[str, bytes]] | None]:
    kind = draw(st.sampled_from(["valid", "framing", "bytes"]))
    if kind == "valid":
        return draw(_requests())
    wire, _ = draw(_requests(hostile=True))
    if kind == "framing":
        return wire, None
    data = bytearray(wire)
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(data)))
        op = draw(st.sampled_from(["insert", "delete", "duplicate", "byte", "truncate"]))
        if op == "insert":
            data[at:at] = draw(st.sampled_from(_INSERTS) | st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del data[at:at + draw(st.integers(1, 8))]
        elif op == "duplicate":
            data[at:at] = data[at:at + draw(st.integers(1, 40))]
        elif op == "byte" and at < len(data):
            data[at] = draw(st.integers(0, 255))
        else:
            del data[at:]
    return bytes(data), None


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=_mutated(), cuts=st.lists(st.integers(1, 700), max_size=12))
def test_the_parser_holds_no_more_than_its_limits_and_fails_only_one_way(
    case: tuple[bytes, list[tuple[str, bytes]] | None], cuts: list[int]
) -> None:
    """Valid requests, and mutations of them (chunk sizes, lengths, header lines, stray
    CR, LF and NUL, truncations), fed in pieces split at random: whenever the parser asks
    for more it holds less than the limit of what it waits for (a head; a chunk-size line
    or the trailers; nothing inside a sized body), every input ends in requests or one
    :class:`BadRequest`, and unmutated input parses to exactly what was sent."""
    from federation_sender.transport.proxy_http import BadRequest, Event, Request, RequestParser

    data, expected = case
    pieces: list[bytes] = []
    for cut in cuts:
        if data:
            pieces.append(data[:cut])
            data = data[cut:]
    pieces.append(data)
    parser = RequestParser(max_head_bytes=MAX_HEAD, max_chunk_line_bytes=MAX_LINE,
                           max_trailer_bytes=MAX_TRAILERS)
    got: list[tuple[str, bytes]] = []
    body: bytearray | None = None
    chunked = False
    eof = False
    try:
        while True:
            event = parser.next_event()
            if isinstance(event, Request):
                got.append((event.target, b""))
                body = bytearray() if event.announces_body else None
                chunked = event.chunked
            elif isinstance(event, bytes):
                assert body is not None and event
                body += event
            elif event is Event.END:
                assert body is not None
                got[-1] = (got[-1][0], bytes(body))
                body = None
            elif event is Event.CLOSED:
                assert eof and body is None
                break
            else:
                assert not eof  # after the end of input: requests or an error, no waiting
                if body is None:
                    assert parser.buffered < MAX_HEAD
                elif chunked:
                    assert parser.buffered < max(MAX_LINE, MAX_TRAILERS)
                else:
                    assert parser.buffered == 0
                piece = pieces.pop(0) if pieces else b""
                eof = not piece
                parser.feed(piece)
    except BadRequest:
        assert expected is None
        return
    if expected is not None:
        assert got == expected
