"""Hostile federation peers written at the socket level, for the reliability tests.

Each handler gets the connection after accept (plain TCP, or after a TLS handshake when
the server has an SSL context) and may write anything, forever. The server tracks its
handler tasks so teardown never leaves one running.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

RawHandler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@dataclass
class RawPeer:
    handler: RawHandler
    port: int = 0
    connections: int = 0
    bytes_written: int = 0
    _server: asyncio.Server | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self, ssl_context: ssl.SSLContext | None = None) -> RawPeer:
        self._server = await asyncio.start_server(
            self._on_connect, "127.0.0.1", 0, ssl=ssl_context
        )
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            await self.handler(reader, writer)
        except (ConnectionError, ssl.SSLError, asyncio.CancelledError):
            pass  # the client gave up, or teardown cancelled us: both expected
        finally:
            self._tasks.discard(task)
            writer.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await self._server.wait_closed()


async def read_request(reader: asyncio.StreamReader) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    await reader.readexactly(length)


OK_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"


async def endless_body(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    """A chunked 200 that never ends."""
    await read_request(r)
    w.write(OK_HEAD + b"Transfer-Encoding: chunked\r\n\r\n")
    chunk = b"[" * 16384
    while True:
        w.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        await w.drain()


async def endless_unframed_body(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    """A 200 with neither length nor chunking: the body runs until close, i.e. never."""
    await read_request(r)
    w.write(OK_HEAD + b"Connection: close\r\n\r\n")
    while True:
        w.write(b" " * 16384)
        await w.drain()


async def invalid_json(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    await read_request(r)
    body = b'{"pdus": {"$a": {"error": ' + b"\xff\xfe" * 10 + b"}"
    w.write(OK_HEAD + b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    await w.drain()


async def deeply_nested_json(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    """Valid JSON that a recursive parser cannot handle: 30,000 nested arrays."""
    await read_request(r)
    body = b"[" * 30_000 + b"]" * 30_000
    w.write(OK_HEAD + b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    await w.drain()


async def huge_header(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    await read_request(r)
    w.write(b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * 1_000_000 + b"\r\n\r\n{}")
    await w.drain()


async def endless_headers(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    await read_request(r)
    w.write(b"HTTP/1.1 200 OK\r\n")
    i = 0
    while True:
        w.write(b"X-H%d: %s\r\n" % (i, b"v" * 100))
        i += 1
        if i % 100 == 0:
            await w.drain()


async def slow_drip_headers(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    await read_request(r)
    for byte in OK_HEAD * 1000:
        w.write(bytes([byte]))
        await w.drain()
        await asyncio.sleep(0.02)  # the scenario: a peer that drips its headers


async def slow_drip_body(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    await read_request(r)
    w.write(OK_HEAD + b"Content-Length: 1000\r\n\r\n")
    while True:
        w.write(b" ")
        await w.drain()
        await asyncio.sleep(0.02)  # the scenario: a peer that drips its body


async def never_answers(r: asyncio.StreamReader, _w: asyncio.StreamWriter) -> None:
    await read_request(r)
    await r.read()  # until the client gives up and closes


async def never_reads(_r: asyncio.StreamReader, _w: asyncio.StreamWriter) -> None:
    """Accepts and never answers, not even the request line (on a TLS port without a
    server context: never finishes the handshake). Returns when the client closes."""
    await _r.read()


async def garbage_status_line(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    await read_request(r)
    w.write(b"\x16\x03\x01\x02\x00garbage\x00\xff\r\n\r\n")
    await w.drain()


async def plain_http_on_tls_port(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    """Answers a TLS ClientHello with plain HTTP text."""
    w.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
    await w.drain()


async def reset_immediately(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    w.transport.abort()


def redirect(location: str, status: int = 307) -> RawHandler:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 %d Moved\r\nLocation: %s\r\nContent-Length: 0\r\n\r\n"
                % (status, location.encode()))
        await w.drain()

    return handler


class TooManyRequests:
    """Answers every request of every connection (keep-alive) with 429 and
    ``Retry-After: <retry_after>``, counting them; a handler."""

    def __init__(self, retry_after: str = "0") -> None:
        self.retry_after = retry_after
        self.requests = 0

    async def __call__(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        body = b'{"errcode":"M_LIMIT_EXCEEDED","error":"Too Many Requests"}'
        head = (b"HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json\r\n"
                b"Retry-After: %s\r\nContent-Length: %d\r\n\r\n"
                % (self.retry_after.encode(), len(body)))
        while True:
            try:
                await read_request(r)
            except asyncio.IncompleteReadError:
                return  # the client closed the connection
            self.requests += 1
            w.write(head + body)
            await w.drain()


def handler_by_name(spec: str) -> RawHandler:
    """``endless_body`` or ``redirect:307:http://x/``: a handler from its name."""
    name, _, args = spec.partition(":")
    if name == "redirect":
        status, _, location = args.partition(":")
        return redirect(location, int(status))
    handler: RawHandler = globals()[name]
    return handler


class ProcessPeer:
    """A :class:`RawPeer` in its own process, so that a peer spinning on the CPU (an
    endless stream) competes with the client as a remote machine would, not for the
    client's own event loop, and so that ``tracemalloc`` sees only the client."""

    def __init__(self, spec: str) -> None:
        self.spec = spec
        self.port = 0
        self._proc: asyncio.subprocess.Process | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> ProcessPeer:
        self._proc = await asyncio.create_subprocess_exec(
            sys.executable, __file__, self.spec, stdout=asyncio.subprocess.PIPE
        )
        assert self._proc.stdout is not None
        line = await asyncio.wait_for(self._proc.stdout.readline(), 30)
        self.port = int(line)
        return self

    async def close(self) -> None:
        if self._proc is not None and self._proc.returncode is None:
            self._proc.kill()
            await self._proc.wait()


async def _serve_forever(spec: str) -> None:
    peer = await RawPeer(handler_by_name(spec)).start()
    print(peer.port, flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(_serve_forever(sys.argv[1]))
