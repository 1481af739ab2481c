"""The outbound federation proxy: Synapse's ``outbound_federation_restricted_to``.

Theory of operation
-------------------
A Synapse deployment with ``outbound_federation_restricted_to: [fed1]`` lets only
``fed1`` talk to remote servers. Main and every other worker send each outbound
federation request (joins, backfill, profile and directory queries, key fetches,
media) to ``fed1`` as an HTTP/1.1 request in absolute form::

    GET matrix-federation://remote.example/_matrix/federation/v1/... HTTP/1.1
    Proxy-Authorization: Bearer <worker_replication_secret>
    Authorization: X-Matrix origin=...,key=...,sig=...   (signed by the caller)

at the address ``instance_map`` gives for ``fed1`` (host and port, optionally TLS, or a
Unix socket). When our worker runs as ``fed1``, :class:`OutboundProxyServer` serves
that address. aiohttp's server cannot: its parser refuses a ``-`` in a URI scheme, so
this is a small HTTP/1.1 server of its own on asyncio streams.

For each request:

1. the target must be ``matrix-federation://<destination>/<path>``; anything else gets
   404, except ``GET /health`` (every Synapse listener answers it);
2. exactly one ``Proxy-Authorization: Bearer <secret>`` header with the deployment's
   ``worker_replication_secret``, compared in constant time; otherwise 401 with
   Synapse's errcodes (``M_MISSING_TOKEN`` when absent, ``M_UNAUTHORIZED`` when
   repeated or wrong);
3. the request goes out through our federation client
   (:meth:`FederationClient.open_stream`): discovery of ``<destination>``
   (well-known, SRV), the Host header and TLS server name discovery gives, certificate
   verification, the IP range policy, the forward proxy settings and the connection
   pool. Only ``User-Agent``, ``Authorization`` and ``Content-Type`` are forwarded (and
   the body's framing);
4. the response comes back as it arrives: status, headers minus the hop-by-hop ones
   (and those the remote's ``Connection`` header names), body in chunks of at most
   :data:`CHUNK_BYTES`, written as the caller reads them. Neither body is held whole:
   the request body streams to the remote the same way.

The remote has :data:`FORWARD_TIMEOUT_S` (90 s, Synapse's figure) to send its response
head, and then as long for each read of the body. A failure before the response head
is a 502 with ``M_UNKNOWN``; a failure after it aborts the caller's connection (the
caller sees a truncated response, as with Synapse's proxy).

Every proxied request is counted (:class:`ProxyMetrics`) and logged on one line by the
``federation_sender.outbound_proxy.access`` logger: method, destination, path (without
its query string), status, bytes and seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import ssl
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter

from federation_sender.clock import Clock
from federation_sender.errors import StartupError

if TYPE_CHECKING:
    from federation_sender.transport.client import FederationClient

logger = logging.getLogger(__name__)
access_log = logging.getLogger("federation_sender.outbound_proxy.access")

SCHEME = "matrix-federation://"
FORWARD_TIMEOUT_S = 90.0
"""Synapse's: longer than its federation client's own timeout, so the caller's gives up
first."""
CHUNK_BYTES = 64 * 1024
IDLE_TIMEOUT_S = 60.0
"""A caller's connection waiting longer for its next request head is closed."""
MAX_HEAD_BYTES = 64 * 1024
MAX_HEADERS = 128
FORWARDED_HEADERS = ("user-agent", "authorization", "content-type")
HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
    "trailers", "transfer-encoding", "upgrade",
})  # fmt: skip

REQUESTS_METRIC = "federation_sender_outbound_proxy_requests"
BYTES_METRIC = "federation_sender_outbound_proxy_response_bytes"


class ProxyMetrics:
    """Proxied requests by method and status (``code="error"``: no response from the
    remote), and the response bytes passed back."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.requests = Counter(REQUESTS_METRIC, "Requests served by the outbound "
                                "federation proxy", ["method", "code"], registry=registry)
        self.response_bytes = Counter(BYTES_METRIC, "Response body bytes passed back by the "
                                      "outbound federation proxy", registry=registry)


@dataclass(frozen=True)
class ProxyLocation:
    """Where the proxy listens: ``instance_map``'s entry for our instance."""

    host: str | None = None
    port: int | None = None
    tls: bool = False
    path: str | None = None
    """A Unix socket (then host and port are unset)."""

    def describe(self) -> str:
        if self.path is not None:
            return f"unix:{self.path}"
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.port}"


class _BadRequest(Exception):
    pass


@dataclass
class _Request:
    method: str
    target: str
    headers: list[tuple[str, str]]
    """Names lower-cased, in order, repeats kept."""
    keep_alive: bool

    def all(self, name: str) -> list[str]:
        return [v for k, v in self.headers if k == name]

    def get(self, name: str) -> str | None:
        values = self.all(name)
        return values[-1] if values else None


class _BodyReader:
    """The request body, read from the caller's connection as the remote asks for it."""

    def __init__(self, reader: asyncio.StreamReader, length: int | None, chunked: bool) -> None:
        self._reader = reader
        self._left = length or 0
        self._chunked = chunked
        self.done = not chunked and not self._left

    async def chunks(self) -> AsyncIterator[bytes]:
        if self._chunked:
            async for chunk in self._dechunk():
                yield chunk
        else:
            while self._left:
                data = await self._reader.read(min(CHUNK_BYTES, self._left))
                if not data:
                    raise _BadRequest("request body ended early")
                self._left -= len(data)
                yield data
        self.done = True

    async def _dechunk(self) -> AsyncIterator[bytes]:
        reader = self._reader
        while True:
            line = await reader.readuntil(b"\r\n")
            size_text = line.split(b";", 1)[0].strip()
            if not size_text or len(size_text) > 16:
                raise _BadRequest("malformed chunk size")
            try:
                size = int(size_text, 16)
            except ValueError:
                raise _BadRequest("malformed chunk size") from None
            if size == 0:
                while (await reader.readuntil(b"\r\n")) != b"\r\n":
                    pass  # trailers are not forwarded
                return
            while size:
                data = await reader.read(min(CHUNK_BYTES, size))
                if not data:
                    raise _BadRequest("request body ended early")
                size -= len(data)
                yield data
            if await reader.readexactly(2) != b"\r\n":
                raise _BadRequest("malformed chunk")

    async def drain(self) -> None:
        if not self.done:
            async for _ in self.chunks():
                pass


class OutboundProxyServer:
    """Serves ``matrix-federation://`` requests; see the module docstring."""

    def __init__(
        self,
        client: FederationClient,
        *,
        secret: str,
        location: ProxyLocation,
        clock: Clock,
        registry: CollectorRegistry | None = None,
        tls: ssl.SSLContext | None = None,
        forward_timeout_s: float = FORWARD_TIMEOUT_S,
        bind: str | list[str] | None = None,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
    ) -> None:
        """``bind``: the address to listen on instead of ``location.host`` (the name
        callers connect to may not be a local address, e.g. behind NAT). ``tls``: the
        server context when ``location.tls``."""
        if not secret:
            raise ValueError("the outbound federation proxy needs worker_replication_secret")
        self._client = client
        self._secret = secret.encode("utf-8")
        self._location = location
        self._clock = clock
        self._tls = tls
        self._timeout_s = forward_timeout_s
        self._bind = bind
        self._idle_timeout_s = idle_timeout_s
        self.metrics = ProxyMetrics(registry)
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self.port: int | None = None
        """The TCP port bound (``location.port`` 0: an ephemeral one, for tests)."""

    async def start(self) -> None:
        """Listen; a taken or unusable address is one :class:`StartupError` line."""
        try:
            await self._listen()
        except OSError as e:
            raise StartupError(
                f"outbound federation proxy: cannot listen on {self._location.describe()}: "
                f"{e.strerror or e}"
            ) from None

    async def _listen(self) -> None:
        loc = self._location
        if loc.path is not None:
            _unlink_socket(loc.path)  # a stale socket of an earlier run
            self._server = await asyncio.start_unix_server(
                self._serve, path=loc.path, ssl=self._tls, limit=MAX_HEAD_BYTES
            )
        else:
            self._server = await asyncio.start_server(
                self._serve, host=self._bind or loc.host, port=loc.port, ssl=self._tls,
                limit=MAX_HEAD_BYTES,
            )  # fmt: skip
            self.port = int(self._server.sockets[0].getsockname()[1])
        logger.info("outbound federation proxy listening on %s", loc.describe())

    async def close(self) -> None:
        server = self._server
        self._server = None
        if server is None:
            return
        server.close()
        for task in list(self._connections):
            task.cancel()
        if self._connections:
            await asyncio.gather(*self._connections, return_exceptions=True)
        await server.wait_closed()
        if self._location.path is not None:
            _unlink_socket(self._location.path)

    # --- connections ------------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            while True:
                try:
                    async with asyncio.timeout(self._idle_timeout_s):
                        request = await _read_head(reader)
                except (asyncio.IncompleteReadError, ConnectionError, TimeoutError):
                    return  # the caller closed its (idle) connection, or left it idle
                except (_BadRequest, asyncio.LimitOverrunError, ValueError) as e:
                    await _write_json(writer, 400, "M_UNKNOWN", f"bad request: {e}", False)
                    return
                if not await self._handle(request, reader, writer):
                    return
        except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError, _BadRequest):
            pass
        finally:
            self._connections.discard(task)
            writer.transport.abort()

    async def _handle(self, request: _Request, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> bool:
        """Serve one request; whether the connection may carry another."""
        try:
            body = _body_reader(request, reader)
        except _BadRequest as e:
            await _write_json(writer, 400, "M_UNKNOWN", f"bad request: {e}", False)
            return False
        keep = request.keep_alive
        if not request.target.startswith(SCHEME):
            await body.drain()
            if request.method in ("GET", "HEAD") and request.target.split("?")[0] == "/health":
                await _write_raw(writer, 200, [("content-type", "text/plain")], b"OK", keep)
            else:
                await _write_json(writer, 404, "M_UNRECOGNIZED", "Unrecognized request", keep)
            return keep
        denied = self._check_auth(request)
        if denied is not None:
            await body.drain()
            await _write_json(writer, 401, denied[0], denied[1], keep)
            self.metrics.requests.labels(request.method, "401").inc()
            return keep
        return await self._forward(request, body, writer)

    def _check_auth(self, request: _Request) -> tuple[str, str] | None:
        """None, or (errcode, message) of the 401, as Synapse's proxy words them."""
        values = request.all("proxy-authorization")
        if not values:
            return "M_MISSING_TOKEN", "Missing Proxy-Authorization header."
        if len(values) > 1:
            return "M_UNAUTHORIZED", "Too many Proxy-Authorization headers."
        scheme, _, secret = values[0].partition(" ")
        if scheme == "Bearer" and secret and " " not in secret and hmac.compare_digest(
            secret.encode("utf-8"), self._secret
        ):
            return None
        return "M_UNAUTHORIZED", "Invalid Proxy-Authorization header."

    async def _forward(self, request: _Request, body: _BodyReader,
                       writer: asyncio.StreamWriter) -> bool:
        started = self._clock.monotonic_s()
        rest = request.target[len(SCHEME):]
        destination, slash, path = rest.partition("/")
        path = slash + path
        if not destination or not path:
            await body.drain()
            await _write_json(writer, 400, "M_UNKNOWN", "bad matrix-federation URI", False)
            return False
        headers = {name: value for name in FORWARDED_HEADERS
                   if (value := request.get(name)) is not None}
        length = request.get("content-length")
        if length is not None:
            headers["content-length"] = length
        data = None if body.done else body.chunks()
        status: str = "error"
        sent = 0
        head_written = False
        try:
            async with self._client.open_stream(
                request.method, destination, path, headers, data, timeout_s=self._timeout_s
            ) as response:
                status = str(response.status)
                out_headers = _response_headers(response.raw_headers)
                length_out = response.headers.get("Content-Length")
                chunked = length_out is None and _has_body(request.method, response.status)
                if chunked:
                    out_headers.append(("Transfer-Encoding", "chunked"))
                writer.write(_status_line(response.status, response.reason) +
                             _encode_headers(out_headers, request.keep_alive))
                head_written = True
                async for chunk in response.content.iter_chunked(CHUNK_BYTES):
                    sent += len(chunk)
                    writer.write(b"%x\r\n%b\r\n" % (len(chunk), chunk) if chunked else chunk)
                    await writer.drain()
                if chunked:
                    writer.write(b"0\r\n\r\n")
                await writer.drain()
        except Exception as e:  # every failure of the forward is answered
            elapsed = self._clock.monotonic_s() - started
            self._log(request, destination, path, f"failed ({_describe(e)})", sent, elapsed)
            self.metrics.requests.labels(request.method, status).inc()
            self.metrics.response_bytes.inc(sent)
            if head_written or isinstance(e, ConnectionError):
                writer.transport.abort()
                return False
            await _write_json(
                writer, 502, "M_UNKNOWN",
                f"Error when proxying request: {request.method} {destination}{_no_query(path)}"
                f" -> {_describe(e)}", False,
            )  # fmt: skip
            return False
        elapsed = self._clock.monotonic_s() - started
        self._log(request, destination, path, status, sent, elapsed)
        self.metrics.requests.labels(request.method, status).inc()
        self.metrics.response_bytes.inc(sent)
        if not body.done:
            return False  # the remote answered without reading all of the body
        return request.keep_alive

    def _log(self, request: _Request, destination: str, path: str, status: str, sent: int,
             elapsed: float) -> None:
        access_log.info("%s %s%s -> %s (%d bytes, %.3f s)", request.method, destination,
                        _no_query(path), status, sent, elapsed)


def _unlink_socket(path: str) -> None:
    with contextlib.suppress(OSError):
        if Path(path).is_socket():
            Path(path).unlink()


def _no_query(path: str) -> str:
    return path.split("?", 1)[0]


def _describe(e: BaseException) -> str:
    if isinstance(e, TimeoutError):
        return "timed out"
    text = str(e) or type(e).__name__
    return text.splitlines()[0][:200]


def _has_body(method: str, status: int) -> bool:
    return method != "HEAD" and status not in (204, 304) and not 100 <= status < 200


def _response_headers(raw: tuple[tuple[bytes, bytes], ...]) -> list[tuple[str, str]]:
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


def _status_line(status: int, reason: str | None) -> bytes:
    if not reason:
        try:
            reason = HTTPStatus(status).phrase
        except ValueError:
            reason = "Unknown"
    return f"HTTP/1.1 {status} {reason}\r\n".encode("latin-1")


def _encode_headers(headers: list[tuple[str, str]], keep_alive: bool) -> bytes:
    lines = [f"{k}: {v}\r\n" for k, v in headers]
    if not keep_alive:
        lines.append("Connection: close\r\n")
    text = "".join(lines) + "\r\n"
    if text.count("\n") != len(lines) + 1:
        raise ValueError("a response header value contains a line break")
    return text.encode("latin-1")


async def _write_raw(writer: asyncio.StreamWriter, status: int,
                     headers: list[tuple[str, str]], body: bytes, keep_alive: bool) -> None:
    writer.write(_status_line(status, None) + _encode_headers(
        [*headers, ("Content-Length", str(len(body)))], keep_alive) + body)
    await writer.drain()


async def _write_json(writer: asyncio.StreamWriter, status: int, errcode: str, message: str,
                      keep_alive: bool) -> None:
    # Synapse's proxy says "err"; "error" is the Matrix specification's key.
    body = json.dumps({"errcode": errcode, "error": message, "err": message}).encode()
    await _write_raw(writer, status, [("Content-Type", "application/json")], body, keep_alive)


async def _read_head(reader: asyncio.StreamReader) -> _Request:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head[:-4].decode("latin-1").split("\r\n")
    while lines and not lines[0]:
        lines.pop(0)  # tolerate blank lines before a request (RFC 9112 2.2)
    if not lines:
        raise _BadRequest("empty request")
    parts = lines[0].split(" ")
    if len(parts) != 3 or parts[2] not in ("HTTP/1.1", "HTTP/1.0") or not parts[0].isalpha():
        raise _BadRequest("malformed request line")
    method, target, version = parts
    if len(lines) > MAX_HEADERS + 1:
        raise _BadRequest("too many headers")
    headers: list[tuple[str, str]] = []
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip() or " " in name:
            raise _BadRequest("malformed header line")
        headers.append((name.lower(), value.strip(" \t")))
    connection = ",".join(v for k, v in headers if k == "connection").lower()
    keep = "close" not in connection if version == "HTTP/1.1" else "keep-alive" in connection
    return _Request(method, target, headers, keep)


def _body_reader(request: _Request, reader: asyncio.StreamReader) -> _BodyReader:
    transfer = request.get("transfer-encoding")
    if transfer is not None:
        if transfer.lower() != "chunked":
            raise _BadRequest("unsupported Transfer-Encoding")
        if request.get("content-length") is not None:
            raise _BadRequest("both Content-Length and Transfer-Encoding")
        return _BodyReader(reader, None, True)
    lengths = set(request.all("content-length"))
    if len(lengths) > 1:
        raise _BadRequest("conflicting Content-Length headers")
    length = lengths.pop() if lengths else None
    if length is not None and (not length.isdigit() or not length.isascii()):
        raise _BadRequest("malformed Content-Length")
    return _BodyReader(reader, int(length) if length is not None else None, False)


def location_from_instance_map(entry: object, key: str,
                               on_error: Callable[[str, str, object], Exception]) -> ProxyLocation:
    """``instance_map.<name>`` as Synapse parses it: ``{host, port, tls}`` or ``{path}``."""
    if not isinstance(entry, dict):
        raise on_error(key, "a mapping with host and port, or path", entry)
    if "path" in entry:
        path = entry["path"]
        if not isinstance(path, str) or not path:
            raise on_error(key + ".path", "a Unix socket path", path)
        return ProxyLocation(path=path)
    host, port, tls = entry.get("host"), entry.get("port"), entry.get("tls", False)
    if not isinstance(host, str) or not host:
        raise on_error(key + ".host", "a host name or address", host)
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise on_error(key + ".port", "a TCP port", port)
    if not isinstance(tls, bool):
        raise on_error(key + ".tls", "true or false", tls)
    return ProxyLocation(host=host, port=port, tls=tls)
