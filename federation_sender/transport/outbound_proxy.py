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
this is a small HTTP/1.1 server of its own on asyncio streams (its side of
the wire in :mod:`.proxy_http`).

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
   :data:`.proxy_http.CHUNK_BYTES`, written as the caller reads them. Neither body is held whole:
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
import logging
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter

from federation_sender.clock import Clock
from federation_sender.errors import StartupError
from federation_sender.transport.proxy_http import (
    CHUNK_BYTES,
    MAX_HEAD_BYTES,
    BadRequest,
    BodyReader,
    Request,
    body_reader,
    encode_headers,
    has_body,
    read_head,
    response_headers,
    status_line,
    write_json,
    write_raw,
)

if TYPE_CHECKING:
    from federation_sender.transport.client import FederationClient

logger = logging.getLogger(__name__)
access_log = logging.getLogger("federation_sender.outbound_proxy.access")

SCHEME = "matrix-federation://"
FORWARD_TIMEOUT_S = 90.0
"""Synapse's: longer than its federation client's own timeout, so the caller's gives up
first."""
IDLE_TIMEOUT_S = 60.0
"""A caller's connection waiting longer for its next request head is closed."""
FORWARDED_HEADERS = ("user-agent", "authorization", "content-type")

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
                        request = await read_head(reader)
                except (asyncio.IncompleteReadError, ConnectionError, TimeoutError):
                    return  # the caller closed its (idle) connection, or left it idle
                except (BadRequest, asyncio.LimitOverrunError, ValueError) as e:
                    await write_json(writer, 400, "M_UNKNOWN", f"bad request: {e}", False)
                    return
                if not await self._handle(request, reader, writer):
                    return
        except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError, BadRequest):
            pass
        finally:
            self._connections.discard(task)
            writer.transport.abort()

    async def _handle(self, request: Request, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> bool:
        """Serve one request; whether the connection may carry another."""
        try:
            body = body_reader(request, reader)
        except BadRequest as e:
            await write_json(writer, 400, "M_UNKNOWN", f"bad request: {e}", False)
            return False
        keep = request.keep_alive
        if not request.target.startswith(SCHEME):
            await body.drain()
            if request.method in ("GET", "HEAD") and request.target.split("?")[0] == "/health":
                await write_raw(writer, 200, [("content-type", "text/plain")], b"OK", keep)
            else:
                await write_json(writer, 404, "M_UNRECOGNIZED", "Unrecognized request", keep)
            return keep
        denied = self._check_auth(request)
        if denied is not None:
            await body.drain()
            await write_json(writer, 401, denied[0], denied[1], keep)
            self.metrics.requests.labels(request.method, "401").inc()
            return keep
        return await self._forward(request, body, writer)

    def _check_auth(self, request: Request) -> tuple[str, str] | None:
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

    async def _forward(self, request: Request, body: BodyReader,
                       writer: asyncio.StreamWriter) -> bool:
        started = self._clock.monotonic_s()
        rest = request.target[len(SCHEME):]
        destination, slash, path = rest.partition("/")
        path = slash + path
        if not destination or not path:
            await body.drain()
            await write_json(writer, 400, "M_UNKNOWN", "bad matrix-federation URI", False)
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
                out_headers = response_headers(response.raw_headers)
                length_out = response.headers.get("Content-Length")
                chunked = length_out is None and has_body(request.method, response.status)
                if chunked:
                    out_headers.append(("Transfer-Encoding", "chunked"))
                writer.write(status_line(response.status, response.reason) +
                             encode_headers(out_headers, request.keep_alive))
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
            await write_json(
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

    def _log(self, request: Request, destination: str, path: str, status: str, sent: int,
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
