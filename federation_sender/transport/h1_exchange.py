"""HTTP/1.1 for ``PUT /send``: one connection's exchange, the response parsed as it arrives.

Theory of operation
-------------------
:class:`Exchange` is the asyncio protocol of one pooled connection
(:mod:`federation_sender.transport.h1` owns the pool): it writes a whole request and
parses the response as it arrives -- a status line and at most ``MAX_HEAD_BYTES`` of
headers (informational 1xx heads skipped, within the same budget), then a body framed
by ``Transfer-Encoding: chunked``, by ``Content-Length``, or by the end of the
connection, never more than ``max_body`` bytes of it, checked as it arrives (a declared
length over the limit fails at once). Compression is never asked for, so the limit is
on what we hold. Redirects are responses like any other: the caller classifies them.

After the response, the connection is reusable only if the response was framed, the
server did not ask to close, nothing followed it and the request was written out in
full. Bytes that arrive on an idle connection close it. A failure is an exception the
classifier knows (:mod:`federation_sender.transport.classify`): :class:`InvalidResponse`,
:class:`Disconnected` (with whether any byte of the response had arrived: a reused
connection closed by the server before that is retried by the pool), or
``ResponseTooLarge``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Protocol, cast

from federation_sender.transport.classify import (
    Disconnected,
    InvalidResponse,
    ResponseTooLarge,
)

__all__ = ["MAX_HEAD_BYTES", "ConnectionOwner", "Exchange", "Response", "get_head",
           "request_head", "status_line"]


class ConnectionOwner(Protocol):
    """The pool of a connection: told when it closes."""

    def forget(self, conn: Exchange) -> None: ...


MAX_HEAD_BYTES = 64 * 1024
"""Status line and headers of one response, informational ones included."""
MAX_HEADERS = 128
MAX_CHUNK_LINE = 1024
"""A chunk-size line (with extensions) or one trailer line."""



@dataclass(frozen=True, slots=True)
class Response:
    status: int
    headers: dict[str, str]
    """Lower-case names; a repeated header keeps its last value."""
    body: bytes


_NO_HEADERS: dict[str, str] = {}
"""Before a response's head is parsed (never written to: each head gets a new dict)."""

# Parser states.
_HEAD, _LENGTH, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_END, _TRAILERS, _TO_EOF, _DONE = range(8)


class Exchange(asyncio.Protocol):
    """One connection: writes a request, parses the response to it as it arrives."""

    __slots__ = (
        "_body", "_buf", "_eof", "_expected", "_head_budget", "_headers", "_keep_alive",
        "_max_body", "_pool", "_scan", "_state", "_status", "_waiter", "idle_since", "transport",
    )

    def __init__(self, pool: ConnectionOwner | None, max_body: int) -> None:
        self._pool = pool
        self._max_body = max_body
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._body = bytearray()
        self._waiter: asyncio.Future[Response] | None = None
        self._eof = False
        self.idle_since = 0.0
        self._reset()

    def _reset(self) -> None:
        self._state = _HEAD
        self._scan = 0
        self._head_budget = MAX_HEAD_BYTES
        self._status = 0
        self._headers: dict[str, str] = _NO_HEADERS
        self._body.clear()
        self._expected = 0
        self._keep_alive = True

    # --- asyncio callbacks ----------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (made by create_connection), but not necessarily a subclass
        # of asyncio.Transport: uvloop's TCP and SSL transports are not.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        waiter = self._waiter
        if waiter is None or waiter.done():
            # Bytes nobody asked for (an idle connection): it cannot be reused.
            self._close()
            return
        self._buf += data
        try:
            self._parse()
        except (InvalidResponse, ResponseTooLarge) as e:
            self._fail(e)

    def eof_received(self) -> bool:
        self._eof = True
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            if self._state == _TO_EOF:
                self._keep_alive = False
                self._complete()
            else:
                self._fail(self._disconnected())
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            if exc is None and self._state == _TO_EOF:
                self._keep_alive = False
                self._complete()
            elif exc is None:
                self._fail(self._disconnected())
            else:
                lost = self._disconnected()
                # A reset before any byte of the response (a reused connection the
                # server had closed while idle: our request met its RST) is one more
                # disconnection, which the pool retries once on a new connection.
                self._fail(Disconnected(f"server disconnected ({type(exc).__name__})",
                                        started=False)
                           if isinstance(exc, ConnectionError) and not lost.started else exc)
        pool = self._pool
        if pool is not None:
            pool.forget(self)

    # --- the exchange ---------------------------------------------------------------

    @property
    def usable(self) -> bool:
        transport = self.transport
        return transport is not None and not self._eof and not transport.is_closing()

    async def request(self, data: bytes) -> tuple[Response, bool]:
        """Send ``data`` (a whole request) and read the response. Returns it and
        whether the connection may carry another request."""
        transport = self.transport
        if transport is None or not self.usable:
            raise Disconnected("server disconnected", started=False)
        self._reset()
        waiter = self._waiter = asyncio.get_running_loop().create_future()
        transport.write(data)
        try:
            response = await waiter
        finally:
            self._waiter = None
        # Reusable only if the response was framed, the server did not ask to close,
        # nothing followed it, and the request was written out in full.
        reusable = (
            self._keep_alive
            and not self._buf
            and self.usable
            and transport.get_write_buffer_size() == 0
        )
        return response, reusable

    def _disconnected(self) -> Disconnected:
        if self._state == _HEAD and not self._buf and self._status == 0:
            return Disconnected("server disconnected", started=False)
        return Disconnected("connection broken while reading the response", started=True)

    def _fail(self, exc: BaseException) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)
        self._close()

    def _complete(self) -> None:
        self._state = _DONE
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(Response(self._status, self._headers, bytes(self._body)))
            self._body.clear()  # an idle connection holds no response

    def _close(self) -> None:
        self._keep_alive = False
        transport = self.transport
        if transport is not None:
            transport.abort()

    def close(self) -> None:
        self._close()

    # --- parsing --------------------------------------------------------------------

    def _parse(self) -> None:
        while True:
            state = self._state
            if state == _HEAD:
                if not self._parse_head():
                    return
            elif state == _LENGTH:
                buf = self._buf
                need = self._expected - len(self._body)
                if len(buf) < need:
                    self._body += buf
                    buf.clear()
                    return
                self._body += buf[:need]
                del buf[:need]
                self._complete()
                return
            elif state == _TO_EOF:
                self._take_body(len(self._buf))
                return
            elif state == _DONE or not self._parse_chunked():
                return

    def _take_body(self, n: int) -> None:
        if len(self._body) + n > self._max_body:
            raise ResponseTooLarge(f"response exceeds the {self._max_body} byte limit")
        self._body += self._buf[:n]
        del self._buf[:n]

    def _parse_head(self) -> bool:
        buf = self._buf
        # From where the last search stopped: a head dripped byte by byte is scanned once.
        end = buf.find(b"\r\n\r\n", self._scan, self._head_budget + 4)
        if end < 0:
            if len(buf) > self._head_budget:
                raise InvalidResponse(f"response headers exceed {MAX_HEAD_BYTES} bytes")
            self._scan = max(0, len(buf) - 3)
            return False
        self._scan = 0
        lines = bytes(buf[:end]).split(b"\r\n")
        del buf[: end + 4]
        self._head_budget -= end + 4
        status, http10 = status_line(lines[0])
        if len(lines) > MAX_HEADERS + 1:
            raise InvalidResponse(f"more than {MAX_HEADERS} response headers")
        headers: dict[str, str] = {}
        length: str | None = None
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep or not name or name != name.strip() or b" " in name:
                raise InvalidResponse("malformed header line")
            key = name.decode("latin-1").lower()
            text = value.strip(b" \t").decode("latin-1")
            if key == "content-length":
                if length is not None and length != text:
                    raise InvalidResponse("conflicting Content-Length headers")
                length = text
            headers[key] = text
        if 100 <= status < 200:
            if status == 101:
                raise InvalidResponse("unexpected 101 Switching Protocols")
            return True  # an informational head: the real one follows
        self._status = status
        self._headers = headers
        connection = headers.get("connection", "").lower()
        if http10 or "close" in connection:
            self._keep_alive = False
        transfer = headers.get("transfer-encoding")
        if transfer is not None:
            if transfer.lower() != "chunked":
                raise InvalidResponse("unsupported Transfer-Encoding")
            self._state = _CHUNK_SIZE
        elif status in (204, 304):
            self._complete()
        elif length is not None:
            if not length.isdigit() or not length.isascii():
                raise InvalidResponse("malformed Content-Length")
            self._expected = int(length)
            if self._expected > self._max_body:
                raise ResponseTooLarge(
                    f"response of {self._expected} bytes exceeds the "
                    f"{self._max_body} byte limit"
                )
            self._state = _LENGTH
        else:
            self._keep_alive = False
            self._state = _TO_EOF
        return True

    def _parse_chunked(self) -> bool:
        """One step of a chunked body; False when more bytes are needed."""
        buf = self._buf
        state = self._state
        if state == _CHUNK_DATA:
            n = min(self._expected, len(buf))
            self._take_body(n)
            self._expected -= n
            if self._expected:
                return False
            self._state = _CHUNK_END
            return True
        if state == _CHUNK_END:
            if len(buf) < 2:
                return False
            if buf[:2] != b"\r\n":
                raise InvalidResponse("malformed chunk")
            del buf[:2]
            self._state = _CHUNK_SIZE
            return True
        end = buf.find(b"\r\n", 0, MAX_CHUNK_LINE + 2)
        if end < 0:
            if len(buf) > MAX_CHUNK_LINE:
                raise InvalidResponse("chunk line too long")
            return False
        line = bytes(buf[:end])
        del buf[: end + 2]
        if state == _TRAILERS:
            self._head_budget -= end + 2
            if self._head_budget < 0:
                raise InvalidResponse(f"response trailers exceed {MAX_HEAD_BYTES} bytes")
            if not line:
                self._complete()
            return True
        size = line.split(b";", 1)[0].strip()
        if not size or len(size) > 16 or size.strip(b"0123456789abcdefABCDEF"):
            raise InvalidResponse("malformed chunk size")
        self._expected = int(size, 16)
        if len(self._body) + self._expected > self._max_body:
            raise ResponseTooLarge(f"response exceeds the {self._max_body} byte limit")
        self._state = _CHUNK_DATA if self._expected else _TRAILERS
        return True


def status_line(line: bytes) -> tuple[int, bool]:
    """``(status, whether HTTP/1.0)``, or :class:`InvalidResponse`."""
    version, _, rest = line.partition(b" ")
    if version not in (b"HTTP/1.1", b"HTTP/1.0"):
        raise InvalidResponse("not an HTTP/1.x status line")
    code = rest[:3]
    if len(code) != 3 or not code.isdigit() or rest[3:4] not in (b"", b" "):
        raise InvalidResponse("malformed status line")
    return int(code), version == b"HTTP/1.0"


def request_head(path: str, host_header: str, authorization: str, user_agent: str,
                 length: int) -> bytes:
    """The request line and headers of a ``PUT`` of ``length`` bytes of JSON."""
    text = (
        f"PUT {path} HTTP/1.1\r\nHost: {host_header}\r\nAuthorization: {authorization}\r\n"
        f"User-Agent: {user_agent}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n"
    )
    if text.count("\n") != 7 or text.count("\r") != 7:
        raise ValueError("a request header value contains a line break")
    return text.encode("ascii")


def get_head(path: str, host_header: str, authorization: str, user_agent: str) -> bytes:
    """The request line and headers of a ``GET`` (no body)."""
    text = (
        f"GET {path} HTTP/1.1\r\nHost: {host_header}\r\nAuthorization: {authorization}\r\n"
        f"User-Agent: {user_agent}\r\n\r\n"
    )
    if text.count("\n") != 5 or text.count("\r") != 5:
        raise ValueError("a request header value contains a line break")
    return text.encode("ascii")
