"""HTTP/1.1 for ``PUT /send``: keep-alive connection pools on asyncio's protocol layer.

Theory of operation
-------------------
A federation sender makes one kind of request: a ``PUT`` of a JSON body it has already
built, to a server it has already resolved, read back in full and classified. A general
HTTP client (aiohttp) pays for what this never uses: URL objects, header multidicts,
payload lookups, cookie jars, redirects, a streaming reader. :class:`Http1Pool` does
this one exchange and nothing else:

* **Connections** are pooled per ``(host, port, TLS server name)`` and kept alive while
  the server allows it (HTTP/1.1 without ``Connection: close``, a framed body, nothing
  unasked-for after it). An idle connection is closed after ``keepalive_s`` (the server
  may close it first: it then leaves the pool at once). The most recently used idle
  connection is reused first; a reused one that fails before any byte of a response
  (the server closed it as we sent) is retried once on a new connection -- a ``PUT``
  of the same transaction id is idempotent.
* **Limits**: at most ``max_connections`` connections in use at once and
  ``max_per_host`` per pool key (0: no limit); a request over either waits for one to
  be released. Idle connections do not count (as in aiohttp).
* **Address policy** before every connection: an IP literal is checked, a name is
  resolved (cached ``dns_ttl_s``) through a resolver that drops refused addresses, and
  the socket is made by :meth:`AddressFilter.socket_factory`, which checks the final
  address once more.
* **Connecting** is bounded by ``connect_timeout_s`` per address (addresses are tried
  in order); the TLS handshake, the request and the response are bounded only by the
  caller's deadline, which cancels the exchange and closes its connection.
* **The response** is parsed as it arrives (:class:`_Exchange`): a status line and at
  most ``MAX_HEAD_BYTES`` of headers (informational 1xx heads skipped, within the same
  budget), then a body framed by ``Transfer-Encoding: chunked``, by
  ``Content-Length``, or by the end of the connection -- never more than
  ``max_response_bytes`` of it, checked as it arrives (a declared length over the
  limit fails at once). Compression is never asked for, so the limit is on what we
  hold. Redirects are responses like any other: the caller classifies them.

Failures are exceptions the classifier knows (:mod:`federation_sender.transport.classify`):
:class:`CouldNotConnect` (wrapping the cause: the caller may try the next target),
:class:`InvalidResponse`, :class:`Disconnected`, ``ResponseTooLarge``, or the
``OSError`` / ``ssl.SSLError`` the socket raised.
"""

from __future__ import annotations

import asyncio
import collections
import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import cast

from aiohttp.abc import AbstractResolver

from federation_sender.errors import RemoteTransientError
from federation_sender.transport.addresses import AddressFilter, is_ip_literal
from federation_sender.transport.classify import (
    CouldNotConnect,
    Disconnected,
    InvalidResponse,
    ResponseTooLarge,
)
from federation_sender.transport.forward_proxy import (
    ForwardProxy,
    ProxyAuthError,
    ProxyConnectError,
    ProxyPolicy,
    proxy_auth_message,
)

MAX_HEAD_BYTES = 64 * 1024
"""Status line and headers of one response, informational ones included."""
MAX_HEADERS = 128
MAX_CHUNK_LINE = 1024
"""A chunk-size line (with extensions) or one trailer line."""
KEEPALIVE_S = 15.0
DNS_TTL_S = 10.0
_DNS_CACHE_MAX = 10_000


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


class _Exchange(asyncio.Protocol):
    """One connection: writes a request, parses the response to it as it arrives."""

    __slots__ = (
        "_body", "_buf", "_eof", "_expected", "_head_budget", "_headers", "_keep_alive",
        "_max_body", "_pool", "_scan", "_state", "_status", "_waiter", "idle_since", "transport",
    )

    def __init__(self, pool: _Pool | None, max_body: int) -> None:
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
            else:
                self._fail(exc if exc is not None else self._disconnected())
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
        status, http10 = _status_line(lines[0])
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


def _status_line(line: bytes) -> tuple[int, bool]:
    """``(status, whether HTTP/1.0)``, or :class:`InvalidResponse`."""
    version, _, rest = line.partition(b" ")
    if version not in (b"HTTP/1.1", b"HTTP/1.0"):
        raise InvalidResponse("not an HTTP/1.x status line")
    code = rest[:3]
    if len(code) != 3 or not code.isdigit() or rest[3:4] not in (b"", b" "):
        raise InvalidResponse("malformed status line")
    return int(code), version == b"HTTP/1.0"


class _Pool:
    """Connections to one ``(host, port, TLS name)``."""

    __slots__ = ("idle", "in_use", "key", "owner", "waiting")

    def __init__(self, owner: Http1Pool, key: tuple[str, int, str | None]) -> None:
        self.owner = owner
        self.key = key
        self.idle: collections.deque[_Exchange] = collections.deque()
        """Oldest first: reuse takes from the right, expiry from the left."""
        self.in_use = 0
        self.waiting = 0
        """Requests waiting for a connection slot (the pool must outlive them)."""

    def forget(self, conn: _Exchange) -> None:
        """``conn`` closed: out of the idle list if it is there."""
        try:
            self.idle.remove(conn)
        except ValueError:
            return
        self.owner.drop_if_unused(self)


class Http1Pool:
    """``PUT`` requests over pooled HTTP/1.1 connections. See the module docstring."""

    def __init__(
        self,
        *,
        address_filter: AddressFilter,
        resolver: AbstractResolver,
        ssl_context: ssl.SSLContext | None,
        connect_timeout_s: float,
        max_connections: int,
        max_per_host: int,
        max_response_bytes: int,
        keepalive_s: float = KEEPALIVE_S,
        dns_ttl_s: float = DNS_TTL_S,
        ssl_for: Callable[[str | None], ssl.SSLContext] | None = None,
        proxy_policy: ProxyPolicy | None = None,
    ) -> None:
        """``ssl_context`` None: plain HTTP (tests and the demo only). ``ssl_for``: the
        context for a TLS server name instead of ``ssl_context`` (the certificate
        verification whitelist). ``proxy_policy``: connect through a forward proxy
        (``CONNECT``), see :mod:`federation_sender.transport.forward_proxy`."""
        self._filter = address_filter
        self._resolver = resolver
        self._ssl = ssl_context
        self._ssl_for = ssl_for
        self._proxy = proxy_policy if proxy_policy is not None and proxy_policy.enabled else None
        self._connect_timeout_s = connect_timeout_s
        self._max_connections = max_connections
        self._max_per_host = max_per_host
        self._max_body = max_response_bytes
        self._keepalive_s = keepalive_s
        self._dns_ttl_s = dns_ttl_s
        self._pools: dict[tuple[str, int, str | None], _Pool] = {}
        self._in_use = 0
        self._waiters: collections.deque[tuple[_Pool, asyncio.Future[None]]] = (
            collections.deque()
        )
        self._dns: dict[tuple[str, int], tuple[float, list[tuple[int, tuple[str, int]]]]] = {}
        self._literals: dict[str, bool] = {}
        self._sweeper: asyncio.TimerHandle | None = None
        self._closed = False

    @property
    def idle_connections(self) -> int:
        return sum(len(p.idle) for p in self._pools.values())

    @property
    def pool_keys(self) -> int:
        """Pools held: in use, idle or waited for (the rest are dropped at once)."""
        return len(self._pools)

    async def put(
        self, host: str, port: int, tls_name: str | None, head: bytes, body: bytes
    ) -> Response:
        """Send one request (``head``: request line and headers, ``body``) to
        ``host:port`` and return the response. ``tls_name``: the name the certificate
        must carry (ignored without TLS)."""
        if self._closed:
            raise RuntimeError("Http1Pool used after close()")
        key = (host, port, tls_name if self._ssl is not None else None)
        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools[key] = _Pool(self, key)
        try:
            await self._acquire(pool)
        except BaseException:
            self.drop_if_unused(pool)  # cancelled while waiting for a slot
            raise
        try:
            data = head + body
            while True:
                conn = self._take_idle(pool)
                if conn is None:
                    conn = await self._connect(pool)
                    reused = False
                else:
                    reused = True
                try:
                    response, reusable = await conn.request(data)
                except Disconnected as e:
                    conn.close()
                    if reused and not e.started:
                        continue  # closed by the server while idle: once more, anew
                    raise
                except BaseException:
                    conn.close()  # cancelled (the deadline) or failed mid-exchange
                    raise
                if reusable and not self._closed:
                    conn.idle_since = asyncio.get_running_loop().time()
                    pool.idle.append(conn)
                    self._start_sweeper()
                else:
                    conn.close()
                return response
        finally:
            self._release(pool)

    def _take_idle(self, pool: _Pool) -> _Exchange | None:
        idle = pool.idle
        while idle:
            conn = idle.pop()
            if conn.usable:
                return conn
            conn.close()
        return None

    # --- limits ---------------------------------------------------------------------

    def _full(self, pool: _Pool) -> bool:
        return bool(
            (self._max_connections and self._in_use >= self._max_connections)
            or (self._max_per_host and pool.in_use >= self._max_per_host)
        )

    async def _acquire(self, pool: _Pool) -> None:
        while self._full(pool):
            waiter = asyncio.get_running_loop().create_future()
            entry = (pool, waiter)
            self._waiters.append(entry)
            pool.waiting += 1
            try:
                await waiter
            except BaseException:
                if waiter.done() and not waiter.cancelled():
                    self._wake_next()  # woken, then cancelled: pass the turn on
                elif entry in self._waiters:
                    self._waiters.remove(entry)
                raise
            finally:
                pool.waiting -= 1
        self._in_use += 1
        pool.in_use += 1

    def _release(self, pool: _Pool) -> None:
        self._in_use -= 1
        pool.in_use -= 1
        if self._waiters:
            self._wake_next()
        self.drop_if_unused(pool)

    def _wake_next(self) -> None:
        for entry in self._waiters:
            pool, waiter = entry
            if not waiter.done() and not self._full(pool):
                self._waiters.remove(entry)
                waiter.set_result(None)
                return

    def drop_if_unused(self, pool: _Pool) -> None:
        if (not pool.in_use and not pool.idle and not pool.waiting
                and self._pools.get(pool.key) is pool):
            del self._pools[pool.key]

    # --- connecting -----------------------------------------------------------------

    def _context(self, tls_name: str | None) -> ssl.SSLContext | None:
        if self._ssl is None:
            return None
        return self._ssl_for(tls_name) if self._ssl_for is not None else self._ssl

    async def _connect(self, pool: _Pool) -> _Exchange:
        host, port, tls_name = pool.key
        if self._proxy is not None:
            proxy = self._proxy.proxy_for(host, tls=self._ssl is not None)
            if proxy is not None:
                return await self._connect_via(pool, proxy)
        try:
            addresses = await self._addresses(host, port)
        except (OSError, ValueError, RemoteTransientError) as e:
            raise CouldNotConnect(e) from e
        loop = asyncio.get_running_loop()
        last: BaseException | None = None
        for family, sockaddr in addresses:
            sock: socket.socket | None = None
            try:
                sock = self._filter.socket_factory(
                    (family, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", sockaddr)
                )
                sock.setblocking(False)
                async with asyncio.timeout(self._connect_timeout_s):
                    await loop.sock_connect(sock, sockaddr)
                _, conn = await loop.create_connection(
                    partial(_Exchange, pool, self._max_body),
                    sock=sock,
                    ssl=self._context(tls_name),
                    server_hostname=tls_name if self._ssl is not None else None,
                )
                return conn
            except (OSError, RemoteTransientError) as e:  # incl. TLS and timeouts
                if sock is not None:
                    sock.close()
                last = e
            except BaseException:
                if sock is not None:
                    sock.close()
                raise
        assert last is not None  # _addresses never returns an empty list
        raise CouldNotConnect(last) from last

    async def _connect_via(self, pool: _Pool, proxy: ForwardProxy) -> _Exchange:
        """A tunnel through ``proxy`` (``CONNECT host:port``), then TLS inside it."""
        host, port, tls_name = pool.key
        loop = asyncio.get_running_loop()
        sock: socket.socket | None = None
        try:
            if self._is_literal(host):
                self._filter.check(host)  # the remote is not resolved here, but a literal is
            try:
                infos = await loop.getaddrinfo(proxy.host, proxy.port, type=socket.SOCK_STREAM)
            except OSError as e:
                raise CouldNotConnect(e) from e
            last: OSError | None = None
            for family, type_, proto, _, sockaddr in infos:
                sock = socket.socket(family, type_, proto)
                sock.setblocking(False)
                try:
                    async with asyncio.timeout(self._connect_timeout_s):
                        await loop.sock_connect(sock, sockaddr)
                        await _connect_tunnel(loop, sock, proxy, host, port)
                    break
                except (ProxyAuthError, ProxyConnectError):
                    raise
                except OSError as e:
                    sock.close()
                    sock = None
                    last = e
            if sock is None:
                assert last is not None
                raise CouldNotConnect(last) from last
            _, conn = await loop.create_connection(
                partial(_Exchange, pool, self._max_body),
                sock=sock,
                ssl=self._context(tls_name),
                server_hostname=tls_name if self._ssl is not None else None,
            )
            return conn
        except BaseException:
            if sock is not None:
                sock.close()
            raise

    def _is_literal(self, host: str) -> bool:
        literal = self._literals.get(host)
        if literal is None:
            if len(self._literals) >= _DNS_CACHE_MAX:
                self._literals.clear()
            literal = self._literals[host] = is_ip_literal(host)
        return literal

    async def _addresses(self, host: str, port: int) -> list[tuple[int, tuple[str, int]]]:
        literal = self._literals.get(host)
        if literal is None:
            if len(self._literals) >= _DNS_CACHE_MAX:
                self._literals.clear()
            literal = self._literals[host] = is_ip_literal(host)
        if literal:
            self._filter.check(host)
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            return [(family, (host, port))]
        now = asyncio.get_running_loop().time()
        cached = self._dns.get((host, port))
        if cached is not None and cached[0] > now:
            return cached[1]
        # The resolver drops refused addresses (AddressRefusedError if none is left).
        answers = await self._resolver.resolve(host, port, socket.AF_UNSPEC)
        addresses = [(int(a["family"]), (str(a["host"]), int(a["port"]))) for a in answers]
        if not addresses:
            raise OSError(f"no address for {host!r}")
        if len(self._dns) >= _DNS_CACHE_MAX:
            self._dns.clear()
        self._dns[(host, port)] = (now + self._dns_ttl_s, addresses)
        return addresses

    # --- idle connections -----------------------------------------------------------

    def _start_sweeper(self) -> None:
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().call_later(
                self._keepalive_s / 3, self._sweep
            )

    def _sweep(self) -> None:
        """Close connections idle past ``keepalive_s``; again in a third of it while any
        is idle. On the event loop's clock: the network's time, as the deadlines."""
        self._sweeper = None
        expired = asyncio.get_running_loop().time() - self._keepalive_s
        for pool in list(self._pools.values()):
            idle = pool.idle
            while idle and idle[0].idle_since <= expired:
                idle.popleft().close()
            self.drop_if_unused(pool)
        if self._pools and not self._closed:
            self._start_sweeper()

    async def close(self) -> None:
        """Close every connection (idle ones now; those in use as their requests end)."""
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for pool in list(self._pools.values()):
            while pool.idle:
                pool.idle.pop().close()
        self._pools.clear()
        self._dns.clear()
        await self._resolver.close()  # handed over at construction: the pool's own



async def _connect_tunnel(loop: asyncio.AbstractEventLoop, sock: socket.socket,
                          proxy: ForwardProxy, host: str, port: int) -> None:
    """Ask the proxy on ``sock`` for a tunnel to ``host:port``; return once it is open."""
    authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    lines = [f"CONNECT {authority} HTTP/1.1", f"Host: {authority}"]
    if proxy.authorization is not None:
        lines.append(f"Proxy-Authorization: {proxy.authorization}")
    request = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    if request.count(b"\n") != len(lines) + 1:
        raise ValueError("a CONNECT header contains a line break")
    await loop.sock_sendall(sock, request)
    head = bytearray()
    while b"\r\n\r\n" not in head:
        data = await loop.sock_recv(sock, 4096)
        if not data:
            raise ConnectionResetError(f"forward proxy {proxy.url} closed the connection")
        head += data
        if len(head) > MAX_HEAD_BYTES:
            raise ProxyConnectError(f"forward proxy {proxy.url}: response head too long")
    end = head.index(b"\r\n\r\n")
    status_line = bytes(head[: head.find(b"\r\n")])
    try:
        status, _ = _status_line(status_line)
    except InvalidResponse:
        raise ProxyConnectError(f"forward proxy {proxy.url}: not an HTTP response") from None
    if status in (401, 407):  # 407; some proxies (tinyproxy 1.11) say 401 to bad ones
        raise ProxyAuthError(proxy_auth_message(proxy.url, status, proxy.authorization))
    if not 200 <= status < 300:
        raise ProxyConnectError(f"forward proxy {proxy.url} refused CONNECT {authority}: "
                                f"{status}")
    if end + 4 != len(head):
        # The proxy spoke before the tunnel was used; nothing may come before TLS.
        raise ProxyConnectError(f"forward proxy {proxy.url}: unexpected bytes after CONNECT")


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
