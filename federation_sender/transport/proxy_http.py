"""The outbound federation proxy's side of HTTP/1.1 (:mod:`.outbound_proxy`): requests
read from a caller, responses written back.

Theory of operation
-------------------
:class:`RequestParser` is sans-I/O: it is fed what a caller sent and hands out events
(a :class:`Request` head, body bytes, :attr:`Event.END` of a body, :attr:`Event.NEED_DATA`,
:attr:`Event.CLOSED`), or raises :class:`BadRequest`, the one protocol error. Whenever it
asks for more data it holds less than its limit for what it is waiting for: a head of
:data:`MAX_HEAD_BYTES`, a chunk-size line of :data:`MAX_CHUNK_LINE_BYTES`, a trailer
section of :data:`MAX_TRAILER_BYTES`. Body bytes are handed out as they arrive, never
gathered.

*Heads.* The parser frames a head itself, up to the first CRLF CRLF: every line must end
with CRLF (no bare CR or LF, which h11 would take as line ends where a front proxy might
not), no line may be folded (obs-fold, which h11 would unfold), and empty lines before a
request are skipped (RFC 9112 2.2). h11 then parses the complete head: the request line
(the absolute form ``matrix-federation://host/path`` Synapse's ProxyAgent writes
included), header names and values, exactly one ``Host`` in HTTP/1.1,
``Content-Length`` (repeats of one value are one length, differing ones are refused) and
``Transfer-Encoding`` (``chunked`` only, once). The parser adds what h11 lets through:
both framings at once (h11 lets chunked win), a ``Transfer-Encoding`` in HTTP/1.0,
versions other than 1.0 and 1.1, more than :data:`MAX_HEADERS` header lines.

*Bodies* are framed here, not by h11: its chunked reader accepts whitespace after the
chunk size, any byte but LF in an extension (a bare CR included) and a bare LF ending
the trailer section, each a place where a front proxy could frame the same bytes
differently. A chunk-size line is RFC 9112's and nothing else: ``1*HEXDIG`` (at most 16
digits), extensions ``;name``, ``;name=token`` or ``;name="quoted"`` (whitespace allowed
only around ``;`` and ``=``), CRLF. Chunk data must end with CRLF; trailer lines must be
field lines, and are discarded. ``0x2``, ``+2``, ``0_2``, `` 2``, ``2 ``, ``-1`` are
refused.

:class:`CallerStream` runs the parser over an asyncio stream. A request's body is read
only when the proxy forwards it (:class:`BodyReader`): each read must bring bytes within
``read_timeout_s`` and the whole body must arrive within ``body_timeout_s``
(:class:`BodyTimeout` otherwise).

Responses: headers that only concern one hop (:data:`HOP_BY_HOP`, and those a response's
``Connection`` header names) are not passed back.
"""

from __future__ import annotations

import asyncio
import enum
import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from http import HTTPStatus

import h11

from federation_sender.clock import Clock

CHUNK_BYTES = 64 * 1024
MAX_HEAD_BYTES = 64 * 1024
MAX_HEADERS = 128
MAX_CHUNK_LINE_BYTES = 4096
"""A chunk-size line with its extensions and CRLF (Synapse sends no extensions)."""
MAX_TRAILER_BYTES = 8192
MAX_LENGTH_DIGITS = 19
"""A ``Content-Length`` of more digits is refused (and ``int`` refuses 4,300 anyway)."""
HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
    "trailers", "transfer-encoding", "upgrade",
})  # fmt: skip

_TOKEN = rb"[-!#$%&'*+.^_`|~0-9A-Za-z]+"
_QUOTED = rb'"(?:[\t \x21\x23-\x5b\x5d-\x7e\x80-\xff]|\\[\t \x21-\x7e\x80-\xff])*"'
_BWS = rb"[ \t]*"
_CHUNK_EXT = (rb"(?:" + _BWS + rb";" + _BWS + _TOKEN +
              rb"(?:" + _BWS + rb"=" + _BWS + rb"(?:" + _TOKEN + rb"|" + _QUOTED + rb"))?)*")
_CHUNK_LINE = re.compile(rb"([0-9A-Fa-f]{1,16})" + _CHUNK_EXT)
_FIELD_LINE = re.compile(_TOKEN + rb":[^\x00-\x08\x0a-\x1f\x7f]*")


class BadRequest(Exception):
    """What the caller sent is not a request we accept (answered 400, then closed)."""


class BodyTimeout(Exception):
    """The caller's request body stalled or took too long (answered 408, then closed)."""


class Event(enum.Enum):
    NEED_DATA = "need data"
    END = "end of body"
    CLOSED = "closed between requests"


@dataclass
class Request:
    method: str
    target: str
    headers: list[tuple[str, str]]
    """Names lower-cased, in order, repeats kept."""
    keep_alive: bool
    chunked: bool = False
    length: int = 0
    """The ``Content-Length`` (0 when chunked or absent)."""

    @property
    def announces_body(self) -> bool:
        return self.chunked or self.length > 0

    def all(self, name: str) -> list[str]:
        return [v for k, v in self.headers if k == name]

    def get(self, name: str) -> str | None:
        values = self.all(name)
        return values[-1] if values else None


class _State(enum.Enum):
    HEAD = enum.auto()
    LENGTH = enum.auto()
    CHUNK_LINE = enum.auto()
    CHUNK_DATA = enum.auto()
    CHUNK_END = enum.auto()
    TRAILERS = enum.auto()


class RequestParser:
    """One connection's requests, from its bytes (see the module docstring). A request
    that announces a body is followed by its bytes and :attr:`Event.END`; a request
    without one by the next request."""

    def __init__(self, *, max_head_bytes: int = MAX_HEAD_BYTES,
                 max_chunk_line_bytes: int = MAX_CHUNK_LINE_BYTES,
                 max_trailer_bytes: int = MAX_TRAILER_BYTES) -> None:
        self.max_head_bytes = max_head_bytes
        self.max_chunk_line_bytes = max_chunk_line_bytes
        self.max_trailer_bytes = max_trailer_bytes
        self._buf = bytearray()
        self._eof = False
        self._state = _State.HEAD
        self._left = 0
        """Body bytes still to come: of the Content-Length, or of the current chunk."""
        self._scanned = 0
        """How much of the buffered head was searched for its end (no rescans)."""
        self._trailer_bytes = 0

    @property
    def buffered(self) -> int:
        return len(self._buf)

    def feed(self, data: bytes) -> None:
        """What the caller sent next; ``b""`` when it closed its side."""
        if data:
            self._buf += data
        else:
            self._eof = True

    def next_event(self) -> Request | bytes | Event:
        while True:
            event = self._step()
            if event is not None:
                return event

    def _step(self) -> Request | bytes | Event | None:
        """An event, or None after a change of state that produced none."""
        state = self._state
        if state is _State.HEAD:
            return self._head()
        if state is _State.LENGTH or state is _State.CHUNK_DATA:
            return self._data()
        if state is _State.CHUNK_LINE:
            return self._chunk_line()
        if state is _State.CHUNK_END:
            return self._chunk_end()
        return self._trailers()

    def _more(self, what: str) -> Event:
        if self._eof:
            raise BadRequest(f"the connection closed in {what}")
        return Event.NEED_DATA

    def _head(self) -> Request | Event | None:
        buf = self._buf
        while buf[:2] == b"\r\n":
            del buf[:2]
            self._scanned = 0
        end = buf.find(b"\r\n\r\n", max(0, self._scanned - 3))
        if end < 0:
            if len(buf) >= self.max_head_bytes:
                raise BadRequest("request head too large")
            if self._eof and not buf:
                return Event.CLOSED
            self._scanned = len(buf)
            return self._more("a request head")
        size = end + 4
        if size > self.max_head_bytes:
            raise BadRequest("request head too large")
        head = bytes(buf[:size])
        del buf[:size]
        self._scanned = 0
        request = _parse_head(head)
        if request.chunked:
            self._state = _State.CHUNK_LINE
        elif request.length:
            self._state = _State.LENGTH
            self._left = request.length
        return request

    def _data(self) -> bytes | Event | None:
        if not self._left:
            if self._state is _State.CHUNK_DATA:
                self._state = _State.CHUNK_END
                return None
            self._state = _State.HEAD
            return Event.END
        buf = self._buf
        if not buf:
            return self._more("a request body")
        n = min(len(buf), self._left)
        data = bytes(buf[:n])
        del buf[:n]
        self._left -= n
        return data

    def _chunk_line(self) -> Event | None:
        buf = self._buf
        end = buf.find(b"\r\n")
        if end < 0:
            if len(buf) >= self.max_chunk_line_bytes:
                raise BadRequest("chunk-size line too long")
            return self._more("a chunk-size line")
        if end + 2 > self.max_chunk_line_bytes:
            raise BadRequest("chunk-size line too long")
        match = _CHUNK_LINE.fullmatch(buf, 0, end)
        if match is None:
            raise BadRequest("malformed chunk size")
        size = int(match.group(1), 16)
        del buf[:end + 2]
        if size:
            self._state = _State.CHUNK_DATA
            self._left = size
        else:
            self._state = _State.TRAILERS
            self._trailer_bytes = 0
        return None

    def _chunk_end(self) -> Event | None:
        buf = self._buf
        if buf[:2] != b"\r\n"[:len(buf)]:
            raise BadRequest("chunk data does not end with CRLF")
        if len(buf) < 2:
            return self._more("a chunk")
        del buf[:2]
        self._state = _State.CHUNK_LINE
        return None

    def _trailers(self) -> Event | None:
        buf = self._buf
        end = buf.find(b"\r\n")
        if end < 0:
            if self._trailer_bytes + len(buf) >= self.max_trailer_bytes:
                raise BadRequest("trailer section too large")
            return self._more("the trailer section")
        self._trailer_bytes += end + 2
        if self._trailer_bytes > self.max_trailer_bytes:
            raise BadRequest("trailer section too large")
        if end == 0:
            del buf[:2]
            self._state = _State.HEAD
            return Event.END
        if _FIELD_LINE.fullmatch(buf, 0, end) is None:
            raise BadRequest("malformed trailer field")
        del buf[:end + 2]  # trailers are not forwarded
        return None


def _parse_head(head: bytes) -> Request:
    """A complete head, CRLF CRLF included, through h11 and the checks it does not make."""
    crlf = head.count(b"\r\n")
    if head.count(b"\n") != crlf or head.count(b"\r") != crlf:
        raise BadRequest("a line of the request head does not end with CRLF")
    if b"\r\n " in head or b"\r\n\t" in head:
        raise BadRequest("folded header line")
    if crlf - 2 > MAX_HEADERS:
        raise BadRequest("too many headers")
    parser = h11.Connection(h11.SERVER)
    parser.receive_data(head)
    try:
        event = parser.next_event()
    except h11.ProtocolError as e:
        # Without the offending line h11 quotes: an answer does not echo the caller.
        raise BadRequest(str(e).split(": bytearray(", 1)[0]) from None
    if not isinstance(event, h11.Request):
        raise BadRequest("malformed request head")
    version = event.http_version
    if version not in (b"1.0", b"1.1"):
        raise BadRequest("unsupported HTTP version")
    headers = [(k.decode("ascii"), v.decode("latin-1")) for k, v in event.headers]
    chunked = any(k == "transfer-encoding" for k, _ in headers)
    lengths = [v for k, v in headers if k == "content-length"]
    if chunked and lengths:
        raise BadRequest("both Content-Length and Transfer-Encoding")
    if chunked and version == b"1.0":
        raise BadRequest("Transfer-Encoding in an HTTP/1.0 request")
    if lengths and len(lengths[0]) > MAX_LENGTH_DIGITS:
        raise BadRequest("Content-Length too large")
    tokens = {t.strip() for k, v in headers if k == "connection" for t in v.lower().split(",")}
    keep = "close" not in tokens if version == b"1.1" else "keep-alive" in tokens
    return Request(event.method.decode("ascii"), event.target.decode("ascii"), headers, keep,
                   chunked=chunked, length=int(lengths[0]) if lengths else 0)


class CallerStream:
    """A caller's connection read as requests: :class:`RequestParser` over ``reader``."""

    def __init__(self, reader: asyncio.StreamReader, clock: Clock, *, read_timeout_s: float,
                 body_timeout_s: float) -> None:
        self.reader = reader
        self._clock = clock
        self._parser = RequestParser()
        self._read_timeout_s = read_timeout_s
        self._body_timeout_s = body_timeout_s

    async def next_request(self) -> Request | None:
        """The next request's head; None when the caller closed between requests. The
        caller of this bounds the wait."""
        while True:
            event = self._parser.next_event()
            if isinstance(event, Request):
                return event
            if event is Event.CLOSED:
                return None
            if event is not Event.NEED_DATA:
                raise RuntimeError("the previous request's body was not read")
            self._parser.feed(await self.reader.read(CHUNK_BYTES))

    def body(self, request: Request) -> BodyReader:
        return BodyReader(self, request.announces_body)

    async def body_chunks(self) -> AsyncIterator[bytes]:
        parser = self._parser
        deadline = self._clock.monotonic_s() + self._body_timeout_s
        while True:
            event = parser.next_event()
            if isinstance(event, bytes):
                yield event
                continue
            if event is Event.END:
                return
            if isinstance(event, Request) or event is not Event.NEED_DATA:
                raise RuntimeError("a request body read outside a request")
            left = deadline - self._clock.monotonic_s()
            wait = min(self._read_timeout_s, left)
            try:
                if wait <= 0:
                    raise TimeoutError
                async with asyncio.timeout(wait):
                    data = await self.reader.read(CHUNK_BYTES)
            except TimeoutError:
                if wait < self._read_timeout_s:
                    raise BodyTimeout(f"request body not received within "
                                      f"{self._body_timeout_s:g} s") from None
                raise BodyTimeout(f"no request body bytes for {self._read_timeout_s:g} s"
                                  ) from None
            parser.feed(data)


class BodyReader:
    """The request body, read from the caller's connection as the remote asks for it."""

    def __init__(self, stream: CallerStream, announced: bool) -> None:
        self._stream = stream
        self.done = not announced
        self.error: BadRequest | BodyTimeout | None = None
        """Why reading the body failed: the caller's fault, not the remote's."""

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._stream.body_chunks():
                yield chunk
        except (BadRequest, BodyTimeout) as e:
            self.error = e
            raise
        self.done = True


def has_body(method: str, status: int) -> bool:
    return method != "HEAD" and status not in (204, 304) and not 100 <= status < 200


def response_headers(raw: tuple[tuple[bytes, bytes], ...]) -> list[tuple[str, str]]:
    """The remote's headers minus hop-by-hop ones and those its Connection names."""
    named: set[str] = set()
    for name, value in raw:
        if name.lower() == b"connection":
            named.update(v.strip().lower() for v in value.decode("latin-1").split(","))
    out: list[tuple[str, str]] = []
    for name, value in raw:
        key = name.decode("latin-1")
        lower = key.lower()
        if lower in HOP_BY_HOP or lower in named:
            continue
        out.append((key, value.decode("latin-1")))
    return out


def status_line(status: int, reason: str | None) -> bytes:
    if not reason:
        try:
            reason = HTTPStatus(status).phrase
        except ValueError:
            reason = "Unknown"
    return f"HTTP/1.1 {status} {reason}\r\n".encode("latin-1")


def encode_headers(headers: list[tuple[str, str]], keep_alive: bool) -> bytes:
    lines = [f"{k}: {v}\r\n" for k, v in headers]
    if not keep_alive:
        lines.append("Connection: close\r\n")
    text = "".join(lines) + "\r\n"
    if text.count("\n") != len(lines) + 1:
        raise ValueError("a response header value contains a line break")
    return text.encode("latin-1")


def raw_response(status: int, headers: list[tuple[str, str]], body: bytes,
                 keep_alive: bool) -> bytes:
    return status_line(status, None) + encode_headers(
        [*headers, ("Content-Length", str(len(body)))], keep_alive) + body


def json_response(status: int, errcode: str, message: str, keep_alive: bool) -> bytes:
    # Synapse's proxy says "err"; "error" is the Matrix specification's key.
    body = json.dumps({"errcode": errcode, "error": message, "err": message}).encode()
    return raw_response(status, [("Content-Type", "application/json")], body, keep_alive)


async def write_raw(writer: asyncio.StreamWriter, status: int,
                     headers: list[tuple[str, str]], body: bytes, keep_alive: bool) -> None:
    writer.write(raw_response(status, headers, body, keep_alive))
    await writer.drain()


async def write_json(writer: asyncio.StreamWriter, status: int, errcode: str, message: str,
                      keep_alive: bool) -> None:
    writer.write(json_response(status, errcode, message, keep_alive))
    await writer.drain()
