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
the wire in :mod:`.proxy_http`: heads parsed by h11, bodies framed strictly).

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
   the request body streams to the remote the same way (it is read only for a forward).

The remote has :data:`FORWARD_TIMEOUT_S` (90 s, Synapse's figure) to send its response
head, and then as long for each read of the body. A failure before the response head
is a 502 with ``M_UNKNOWN``; a failure after it aborts the caller's connection (the
caller sees a truncated response, as with Synapse's proxy).

Every proxied request is counted (:class:`ProxyMetrics`) and logged on one line by the
``federation_sender.outbound_proxy.access`` logger: method, destination, path (without
its query string), status, bytes and seconds.

Limits
------
The proxy listens on the internal network, but anyone who reaches it is a stranger until
the token says otherwise, so what it spends before the token is checked is bounded:

* *Nothing of a body before the token.* The 401, the 404 and ``/health`` are answered from
  the head alone; when a body was announced and not read the answer says
  ``Connection: close``, the connection is half-closed so the caller reads the answer,
  whatever it still sends is discarded (at most :data:`LINGER_BYTES` for
  :data:`LINGER_S`), and the connection is closed. Only a forward reads a body.
* *Strict framing* (:mod:`.proxy_http`): a head of at most 64 KiB; chunk sizes
  ``1*HEXDIG`` and RFC 9112's extensions, nothing else; anything else is a 400 and the
  connection is closed.
* *Time.* A head must arrive within ``idle_timeout_s`` (60 s), as the next one on a
  kept-alive connection; each read of a forwarded body must bring bytes within
  ``body_read_timeout_s`` (the idle timeout unless given) and the whole body must arrive
  within ``body_timeout_s`` (:data:`BODY_TIMEOUT_S`, Synapse's 90 s); otherwise 408 (or
  the connection is cut once the response has begun) and the connection is closed. A
  TLS handshake has the idle timeout too.
* *Connections.* At most ``max_connections`` at once, counted from the moment of
  ``accept()`` (a TLS handshake included). One more is refused at once: on plain TCP or
  a Unix socket it gets a fixed 503 (``M_UNKNOWN``, ``Connection: close``) written
  without a task or a read, so an honest caller's log says why; over TLS it is closed
  without a word (a 503 would first cost a handshake, the attacker's price, not ours).
  Refusals are counted (``federation_sender_outbound_proxy_refused_connections``). The
  default is :func:`default_max_connections`: a proxied connection may hold two
  descriptors (the caller's and one to the remote), and the proxy takes at most a
  quarter of ``RLIMIT_NOFILE`` (an eighth, in connections: 128 at 1,024, the most
  1,024, the least 16), leaving the rest to ``/send``, the database and the listeners.
* *Out of descriptors anyway* (``EMFILE`` from the worker's own sockets): the proxy runs
  its own accept loop, so instead of asyncio's accept handler, which logs an error and
  retries for every pending connection on every turn of the loop, it logs one warning,
  stops accepting until one of its connections closes or :data:`ACCEPT_PAUSE_S` has
  passed, and logs once more when accepting works again. Waiting callers stay in the
  kernel's backlog.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hmac
import logging
import resource
import socket
import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge

from federation_sender.clock import Clock
from federation_sender.errors import StartupError
from federation_sender.transport.classify import classify_exception
from federation_sender.transport.proxy_http import (
    CHUNK_BYTES,
    MAX_HEAD_BYTES,
    BadRequest,
    BodyReader,
    BodyTimeout,
    CallerStream,
    Request,
    encode_headers,
    has_body,
    json_response,
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
BODY_TIMEOUT_S = FORWARD_TIMEOUT_S
"""A forwarded request body must arrive whole within this (Synapse's callers send a few
MB at most, at once; their own timeout is shorter)."""
LINGER_S = 1.0
LINGER_BYTES = 64 * 1024
"""After answering without reading an announced body: how long, and how much of what the
caller still sends, is discarded before the connection is closed."""
ACCEPT_PAUSE_S = 1.0
"""Out of file descriptors, the longest wait before accepting is tried again."""
BACKLOG = 100
MIN_CONNECTIONS = 16
MAX_DEFAULT_CONNECTIONS = 1024
FORWARDED_HEADERS = ("user-agent", "authorization", "content-type")
_OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})

REQUESTS_METRIC = "federation_sender_outbound_proxy_requests"
BYTES_METRIC = "federation_sender_outbound_proxy_response_bytes"
REFUSED_METRIC = "federation_sender_outbound_proxy_refused_connections"
CONNECTIONS_METRIC = "federation_sender_outbound_proxy_connections"

_REFUSAL = json_response(503, "M_UNKNOWN", "The outbound federation proxy is at its "
                         "connection limit", False)


def default_max_connections(open_file_limit: int | None = None) -> int:
    """The connection cap when none is configured: an eighth of the open-file limit
    (two descriptors a connection, a quarter of the limit), from 16 to 1,024."""
    if open_file_limit is None:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        open_file_limit = 8 * MAX_DEFAULT_CONNECTIONS if soft == resource.RLIM_INFINITY else soft
    return max(MIN_CONNECTIONS, min(MAX_DEFAULT_CONNECTIONS, open_file_limit // 8))


class ProxyMetrics:
    """Proxied requests by method and status (``code="error"``: no response from the
    remote), the response bytes passed back, open connections and those refused at the
    cap."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.requests = Counter(REQUESTS_METRIC, "Requests served by the outbound "
                                "federation proxy", ["method", "code"], registry=registry)
        self.response_bytes = Counter(BYTES_METRIC, "Response body bytes passed back by the "
                                      "outbound federation proxy", registry=registry)
        self.refused = Counter(REFUSED_METRIC, "Connections to the outbound federation proxy "
                               "refused at its connection limit", registry=registry)
        self.connections = Gauge(CONNECTIONS_METRIC, "Open connections to the outbound "
                                 "federation proxy", registry=registry)


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
        body_read_timeout_s: float | None = None,
        body_timeout_s: float = BODY_TIMEOUT_S,
        max_connections: int | None = None,
    ) -> None:
        """``bind``: the address to listen on instead of ``location.host`` (the name
        callers connect to may not be a local address, e.g. behind NAT). ``tls``: the
        server context when ``location.tls``. ``body_read_timeout_s``: None is
        ``idle_timeout_s``. ``max_connections``: None is :func:`default_max_connections`."""
        if not secret:
            raise ValueError("the outbound federation proxy needs worker_replication_secret")
        if max_connections is not None and max_connections < 1:
            raise ValueError("max_connections must be at least 1")
        self._client = client
        self._secret = secret.encode("utf-8")
        self._location = location
        self._clock = clock
        self._tls = tls
        self._timeout_s = forward_timeout_s
        self._bind = bind
        self._idle_timeout_s = idle_timeout_s
        self._body_read_timeout_s = (idle_timeout_s if body_read_timeout_s is None
                                     else body_read_timeout_s)
        self._body_timeout_s = body_timeout_s
        self.max_connections = (default_max_connections() if max_connections is None
                                else max_connections)
        self._listeners: list[socket.socket] = []
        self._acceptors: list[asyncio.Task[None]] = []
        self._connections: set[asyncio.Task[None]] = set()
        self.metrics = ProxyMetrics(registry)
        self.metrics.connections.set_function(lambda: len(self._connections))
        self._slot_freed = asyncio.Event()
        self.port: int | None = None
        """The TCP port bound (``location.port`` 0: an ephemeral one, for tests)."""

    @property
    def open_connections(self) -> int:
        return len(self._connections)

    async def start(self) -> None:
        """Listen; a taken or unusable address is one :class:`StartupError` line."""
        try:
            self._listeners = self._listen()
        except OSError as e:
            raise StartupError(
                f"outbound federation proxy: cannot listen on {self._location.describe()}: "
                f"{e.strerror or e}"
            ) from None
        self._acceptors = [asyncio.create_task(self._accept(s)) for s in self._listeners]
        logger.info("outbound federation proxy listening on %s (at most %d connections)",
                    self._location.describe(), self.max_connections)

    def _listen(self) -> list[socket.socket]:
        loc = self._location
        if loc.path is not None:
            _unlink_socket(loc.path)  # a stale socket of an earlier run
            return [_unix_listener(loc.path)]
        host = self._bind or loc.host
        listeners = _tcp_listeners([host] if isinstance(host, str) or host is None else host,
                                   loc.port or 0)
        self.port = int(listeners[0].getsockname()[1])
        return listeners

    async def close(self) -> None:
        listeners, self._listeners = self._listeners, []
        if not listeners:
            return
        for task in self._acceptors:
            task.cancel()
        await asyncio.gather(*self._acceptors, return_exceptions=True)
        self._acceptors = []
        for sock in listeners:
            sock.close()
        for task in list(self._connections):
            task.cancel()
        if self._connections:
            await asyncio.gather(*self._connections, return_exceptions=True)
        if self._location.path is not None:
            _unlink_socket(self._location.path)

    # --- connections ------------------------------------------------------------------

    async def _accept(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        starved_since: float | None = None
        while True:
            try:
                conn, _ = await loop.sock_accept(listener)
            except OSError as e:
                if e.errno == errno.ECONNABORTED:
                    continue  # the caller gave up while in the backlog
                if starved_since is None:
                    starved_since = self._clock.monotonic_s()
                    logger.warning(
                        "outbound federation proxy: cannot accept connections (%s); "
                        "trying again when one closes, at least every %g s",
                        e.strerror or e, ACCEPT_PAUSE_S)  # fmt: skip
                if e.errno not in _OUT_OF_RESOURCES:
                    logger.debug("accept failed", exc_info=True)
                await self._wait_for_a_slot()
                continue
            if starved_since is not None:
                logger.warning("outbound federation proxy: accepting connections again "
                               "after %.1f s", self._clock.monotonic_s() - starved_since)
                starved_since = None
            self._admit(conn)

    async def _wait_for_a_slot(self) -> None:
        self._slot_freed.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(ACCEPT_PAUSE_S):
                await self._slot_freed.wait()

    def _admit(self, conn: socket.socket) -> None:
        if len(self._connections) >= self.max_connections:
            self.metrics.refused.inc()
            _refuse(conn, tls=self._tls is not None)
            return
        task = asyncio.create_task(self._serve(conn))
        self._connections.add(task)
        task.add_done_callback(self._closed)

    def _closed(self, task: asyncio.Task[None]) -> None:
        self._connections.discard(task)
        self._slot_freed.set()

    async def _serve(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=MAX_HEAD_BYTES)
        protocol = asyncio.StreamReaderProtocol(reader)
        try:
            if self._tls is None:
                transport, _ = await loop.connect_accepted_socket(lambda: protocol, conn)
            else:
                transport, _ = await loop.connect_accepted_socket(
                    lambda: protocol, conn, ssl=self._tls,
                    ssl_handshake_timeout=self._idle_timeout_s)  # fmt: skip
        except OSError:  # a failed or slow TLS handshake, a caller already gone
            conn.close()
            return
        writer = asyncio.StreamWriter(transport, protocol, reader, loop)
        stream = CallerStream(reader, self._clock, read_timeout_s=self._body_read_timeout_s,
                              body_timeout_s=self._body_timeout_s)
        try:
            while True:
                try:
                    async with asyncio.timeout(self._idle_timeout_s):
                        request = await stream.next_request()
                except (ConnectionError, TimeoutError):
                    return  # the caller closed its connection, or left it idle
                except BadRequest as e:
                    await write_json(writer, 400, "M_UNKNOWN", f"bad request: {e}", False)
                    return
                if request is None or not await self._handle(request, stream, writer):
                    return
        except (ConnectionError, ssl.SSLError, BadRequest, BodyTimeout):
            pass
        finally:
            writer.transport.abort()

    async def _handle(self, request: Request, stream: CallerStream,
                      writer: asyncio.StreamWriter) -> bool:
        """Serve one request; whether the connection may carry another. Only a forward
        reads the body: every other answer comes from the head alone."""
        keep = request.keep_alive and not request.announces_body
        if not request.target.startswith(SCHEME):
            if request.method in ("GET", "HEAD") and request.target.split("?")[0] == "/health":
                await write_raw(writer, 200, [("content-type", "text/plain")], b"OK", keep)
            else:
                await write_json(writer, 404, "M_UNRECOGNIZED", "Unrecognized request", keep)
        elif (denied := self._check_auth(request)) is not None:
            await write_json(writer, 401, denied[0], denied[1], keep)
            self.metrics.requests.labels(request.method, "401").inc()
        else:
            return await self._forward(request, stream.body(request), writer)
        if request.announces_body:
            await _linger(stream.reader, writer)
        return keep

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
            await write_json(writer, 400, "M_UNKNOWN", "bad matrix-federation URI", False)
            return False
        headers = {name: value for name in FORWARDED_HEADERS
                   if (value := request.get(name)) is not None}
        if request.length:
            headers["content-length"] = str(request.length)
        data = body.chunks() if request.announces_body else None
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
            caller = body.error  # the caller's body was at fault, not the remote
            if caller is not None:
                status = "408" if isinstance(caller, BodyTimeout) else "400"
            reason = f"request body: {caller}" if caller is not None else _describe(e)
            self._log(request, destination, path, f"failed ({reason})", sent, elapsed)
            self.metrics.requests.labels(request.method, status).inc()
            self.metrics.response_bytes.inc(sent)
            if head_written or (caller is None and isinstance(e, ConnectionError)):
                writer.transport.abort()
                return False
            if caller is not None:
                await write_json(writer, int(status), "M_UNKNOWN", f"bad request: {caller}",
                                 False)
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


async def _linger(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """After an answer to a request whose body was not read: a FIN after the answer, so
    the caller reads it before its writes fail, and what it still sends discarded for a
    moment (a close with unread bytes is a reset, which can overtake the answer)."""
    if not writer.can_write_eof():
        return  # TLS: no half-close; the caller may see a reset
    discarded = 0
    with contextlib.suppress(TimeoutError, ConnectionError):
        writer.write_eof()
        async with asyncio.timeout(LINGER_S):
            while discarded < LINGER_BYTES and (data := await reader.read(CHUNK_BYTES)):
                discarded += len(data)


def _refuse(conn: socket.socket, *, tls: bool) -> None:
    """Close a connection beyond the cap at once: a 503 on plain TCP (one non-blocking
    send to an empty buffer), nothing over TLS (a handshake first would be our cost)."""
    try:
        if not tls:
            conn.send(_REFUSAL)
            conn.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    finally:
        conn.close()


def _tcp_listeners(hosts: Sequence[str | None], port: int) -> list[socket.socket]:
    """Listening sockets on every address ``hosts`` resolve to, as asyncio's
    ``start_server`` makes them (address reuse, IPv6 sockets IPv6 only)."""
    out: list[socket.socket] = []
    seen: set[tuple[int, object]] = set()
    try:
        for host in hosts:
            for family, kind, proto, _, address in socket.getaddrinfo(
                host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            ):
                if (family, address) in seen:
                    continue
                seen.add((family, address))
                sock = socket.socket(family, kind, proto)
                out.append(sock)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(address)
                sock.listen(BACKLOG)
                sock.setblocking(False)
    except OSError:
        for sock in out:
            sock.close()
        raise
    return out


def _unix_listener(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        sock.listen(BACKLOG)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def _unlink_socket(path: str) -> None:
    with contextlib.suppress(OSError):
        if Path(path).is_socket():
            Path(path).unlink()


def _no_query(path: str) -> str:
    return path.split("?", 1)[0]


def _describe(e: BaseException) -> str:
    """The reason as the federation client's classification words it (the same as a
    transaction's): aiohttp's connector error hides the outbound policy's refusal of a
    name behind its own text, the TLS context's repr included."""
    text = classify_exception(e).error or str(e) or type(e).__name__
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
