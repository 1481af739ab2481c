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
* **The response** is parsed as it arrives, at most ``max_response_bytes`` of it, by
  each connection's protocol (:class:`~federation_sender.transport.h1_exchange.Exchange`).

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
from functools import partial

from aiohttp.abc import AbstractResolver

from federation_sender.errors import RemoteTransientError
from federation_sender.transport.addresses import AddressFilter, is_ip_literal
from federation_sender.transport.classify import CouldNotConnect, Disconnected, InvalidResponse
from federation_sender.transport.forward_proxy import (
    ForwardProxy,
    ProxyAuthError,
    ProxyConnectError,
    ProxyPolicy,
    proxy_auth_message,
)
from federation_sender.transport.h1_exchange import (
    MAX_HEAD_BYTES,
    Exchange,
    Response,
    get_head,
    request_head,
    status_line,
)
from federation_sender.transport.h1_tls import open_connection

__all__ = ["DNS_TTL_S", "KEEPALIVE_S", "Http1Pool", "Response", "get_head", "request_head"]

KEEPALIVE_S = 60.0
"""Idle connections are closed after this (aiohttp: 15 s; Synapse's federation pool: 120 s).
A big room cycles through its destinations more slowly than 15 s under load."""
DNS_TTL_S = 10.0
_DNS_CACHE_MAX = 10_000


class _Pool:
    """Connections to one ``(host, port, TLS name)``."""

    __slots__ = ("idle", "in_use", "key", "owner", "waiting")

    def __init__(self, owner: Http1Pool, key: tuple[str, int, str | None]) -> None:
        self.owner = owner
        self.key = key
        self.idle: collections.deque[Exchange] = collections.deque()
        """Oldest first: reuse takes from the right, expiry from the left."""
        self.in_use = 0
        self.waiting = 0
        """Requests waiting for a connection slot (the pool must outlive them)."""

    def forget(self, conn: Exchange) -> None:
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

    def _take_idle(self, pool: _Pool) -> Exchange | None:
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

    async def _connect(self, pool: _Pool) -> Exchange:
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
                return await open_connection(
                    loop, partial(Exchange, pool, self._max_body), sock,
                    self._context(tls_name), tls_name if self._ssl is not None else None)
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

    async def _connect_via(self, pool: _Pool, proxy: ForwardProxy) -> Exchange:
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
            return await open_connection(
                loop, partial(Exchange, pool, self._max_body), sock,
                self._context(tls_name), tls_name if self._ssl is not None else None)
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
    first = bytes(head[: head.find(b"\r\n")])
    try:
        status, _ = status_line(first)
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
