"""The federation client's requests over aiohttp: ``PUT /send`` when
``federation.http_client = "aiohttp"``, ``GET /event`` (pacing's confirmation) and the
outbound proxy's streamed forwards.

Theory of operation
-------------------
:class:`AiohttpRequests` owns two sessions. The first carries ``/send`` (the fallback
client), ``GET /event`` and well-known discovery, under the client's pool limits
(``max_connections`` in total, ``max_per_host`` per host). The second carries the
outbound proxy's forwards: a pool of its own without the per-host limit (a media
download must not hold up a join to the same server), as Synapse's agent limits
persistent connections only.

Both resolve names through the address policy's resolver and make every socket with
:meth:`AddressFilter.socket_factory`; an IP literal never reaches the resolver, so it
is checked here before each request. TLS follows the client's :class:`TlsChoice`, the
Host header and the TLS server name come from discovery (:class:`ResolvedServer`), and
a forward proxy from the client's :class:`ProxyPolicy`. Responses are not decompressed
(we do not ask for compression), so the size limit is a limit on what we hold.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Mapping

import aiohttp
from aiohttp.payload import BytesPayload
from yarl import URL

from federation_sender.transport.addresses import AddressFilter, FilteringResolver, is_ip_literal
from federation_sender.transport.classify import classify_response
from federation_sender.transport.discovery import ResolvedServer
from federation_sender.transport.forward_proxy import ProxyPolicy
from federation_sender.transport.http import proxy_headers, read_limited
from federation_sender.transport.prepare import PreparedRequest
from federation_sender.transport.result import EventHeld, SendResult
from federation_sender.transport.tls_choice import TlsChoice

_MAX_CACHED = 10_000


def event_held(status: int, body: bytes) -> EventHeld:
    """What a ``GET /event`` answer says. Synapse answers it from its events table (200:
    the event was processed) and a 404 with the JSON body ``""`` when it does not hold
    it (yet); a 404 ``M_UNRECOGNIZED`` or one that is not JSON means the receiver does
    not serve the request; anything else is no answer."""
    if status == 200:
        return EventHeld.YES
    if status != 404:
        return EventHeld.NO_ANSWER
    try:
        answer = json.loads(body)
    except ValueError:
        return EventHeld.UNSUPPORTED
    if isinstance(answer, dict) and answer.get("errcode") == "M_UNRECOGNIZED":
        return EventHeld.UNSUPPORTED
    return EventHeld.NOT_YET


class AiohttpRequests:
    """aiohttp's sessions and the requests made over them. ``start`` before use."""

    def __init__(self, *, https: bool, tls: TlsChoice, address_filter: AddressFilter,
                 proxy: ProxyPolicy | None, resolver: Callable[[], FilteringResolver],
                 max_connections: int, max_per_host: int, connect_timeout_s: float,
                 max_response_bytes: int, user_agent: str) -> None:
        self._scheme = "https" if https else "http"
        self._https = https
        self._tls = tls
        self._filter = address_filter
        self._proxy = proxy
        self._resolver = resolver
        self._max_connections = max_connections
        self._max_per_host = max_per_host
        self._connect_timeout_s = connect_timeout_s
        self._max_response_bytes = max_response_bytes
        self._user_agent = user_agent
        # The hard deadline is the caller's asyncio.timeout(); aiohttp only bounds
        # connecting, so a slow connect can fall through to the next target.
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s)
        self.session: aiohttp.ClientSession | None = None
        self._stream_session: aiohttp.ClientSession | None = None
        self._urls: dict[tuple[str, int, str], URL] = {}
        self._literals: dict[str, bool] = {}

    def start(self) -> aiohttp.ClientSession:
        """Open both sessions; returns the first (well-known discovery shares it)."""
        if self.session is None:
            self.session = self._new_session(self._max_per_host)
            self._stream_session = self._new_session(0)
        return self.session

    def _new_session(self, per_host: int) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                limit=self._max_connections, limit_per_host=per_host,
                resolver=self._resolver(), socket_factory=self._filter.socket_factory,
                ssl=self._tls.default,
            ),
            timeout=self._timeout,
            auto_decompress=False,
            skip_auto_headers=("Accept-Encoding",),
            raise_for_status=False,
        )

    async def close(self) -> None:
        for session in (self.session, self._stream_session):
            if session is not None:
                await session.close()
        self.session = self._stream_session = None

    def _started(self) -> aiohttp.ClientSession:
        if self.session is None:
            raise RuntimeError("FederationClient used before start()")
        return self.session

    def check_literal(self, host: str) -> None:
        """The address policy for an IP literal (aiohttp's resolver never sees these)."""
        known = self._literals.get(host)
        if known is None:
            if len(self._literals) > _MAX_CACHED:
                self._literals.clear()
            known = self._literals[host] = is_ip_literal(host)
        if known:
            self._filter.check(host)

    def forget(self, host: str, port: int) -> None:
        """A dropped destination's target: its cached URL base and literal check go."""
        self._urls.pop((host, port, self._scheme), None)
        self._literals.pop(host, None)

    def _proxy_args(self, host: str) -> tuple[str | None, dict[str, str] | None]:
        """aiohttp's ``proxy=`` and ``proxy_headers=`` for a connection to ``host``."""
        if self._proxy is None:
            return None, None
        proxy = self._proxy.proxy_for(host, tls=self._https)
        return (proxy.url if proxy is not None else None), proxy_headers(proxy)

    def _url(self, host: str, port: int, path: str) -> URL:
        # Transaction paths are unique, so only the base is worth keeping; built per
        # request from it without parsing a URL string.
        key = (host, port, self._scheme)
        base = self._urls.get(key)
        if base is None:
            if len(self._urls) > _MAX_CACHED:
                self._urls.clear()
            base = self._urls[key] = URL.build(scheme=self._scheme, host=host, port=port)
        return base.with_path(path, encoded=True)

    def _tls_args(self, resolved: ResolvedServer) -> tuple[ssl.SSLContext | bool, str | None]:
        """aiohttp's ``ssl=`` and ``server_hostname=`` for a resolved destination."""
        if not self._https:
            return False, None
        return self._tls.for_name(resolved.tls_server_name), resolved.tls_server_name

    async def put(self, host: str, port: int, resolved: ResolvedServer,
                  prepared: PreparedRequest, on_status: Callable[[int], None] | None
                  ) -> SendResult:
        """``PUT /send`` to one target, classified; ``on_status`` is told the status
        before the body is read. Raises what aiohttp raises (connecting: the caller may
        try the next target)."""
        self.check_literal(host)
        proxy, proxy_auth = self._proxy_args(host)
        tls, sni = self._tls_args(resolved)
        async with self._started().put(
            self._url(host, port, prepared.path),
            # A ready payload skips aiohttp's lookup of a payload type per request.
            data=BytesPayload(prepared.body, content_type="application/json"),
            headers={
                "Host": resolved.host_header,
                "Authorization": prepared.authorization,
                "User-Agent": self._user_agent,
            },
            allow_redirects=False, proxy=proxy, proxy_headers=proxy_auth, ssl=tls,
            server_hostname=sni,
        ) as response:
            if on_status is not None:
                on_status(response.status)
            content = await read_limited(response, self._max_response_bytes)
            # Case-insensitive already: classify looks up lower-case names.
            return classify_response(response.status, response.headers, content)

    async def get(self, resolved: ResolvedServer, path: str, authorization: str,
                  timeout_s: float) -> tuple[int, bytes]:
        """A signed ``GET`` of ``path`` from the first target: status and body (at most
        the response limit). Raises what aiohttp, the policy or the deadline raise."""
        host, port = resolved.targets[0]
        self.check_literal(host)
        proxy, proxy_auth = self._proxy_args(host)
        tls, sni = self._tls_args(resolved)
        async with asyncio.timeout(timeout_s), self._started().get(
            self._url(host, port, path),
            headers={"Host": resolved.host_header, "Authorization": authorization,
                     "User-Agent": self._user_agent},
            allow_redirects=False, proxy=proxy, proxy_headers=proxy_auth, ssl=tls,
            server_hostname=sni,
        ) as response:
            return response.status, await read_limited(response, self._max_response_bytes)

    @contextlib.asynccontextmanager
    async def open_stream(
        self,
        method: str,
        resolve: Callable[[], Awaitable[ResolvedServer]],
        path: str,
        headers: Mapping[str, str],
        body: AsyncIterable[bytes] | bytes | None,
        *,
        timeout_s: float,
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """Any request to the destination ``resolve`` finds (the outbound federation
        proxy's forward), yielding the response with its body unread: the caller
        streams it.

        Discovery, the Host header and TLS server name, certificate checks, the address
        policy and the forward proxy are those of ``/send``, over aiohttp (the built-in
        client does whole bodies only) with a pool of its own: ``max_connections`` in
        all, no per-host limit. ``headers`` go as given, the Host
        header added and our User-Agent when none is given. ``timeout_s`` bounds
        discovery, connecting and the response head, and then each read of the body.
        SRV targets are tried in order while connecting fails (the body is not read
        before a connection is made). ``path`` (with its query) is used as given, never
        resolved against the target (``//other.host/`` stays a path). Raises what aiohttp
        or discovery raise."""
        session = self._stream_session
        if session is None:
            raise RuntimeError("FederationClient used before start()")
        out = {"User-Agent": self._user_agent}
        for name, value in headers.items():
            out[name.title() if name.lower() == "user-agent" else name] = value
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=self._connect_timeout_s, sock_read=timeout_s
        )
        async with asyncio.timeout(timeout_s):
            resolved = await resolve()
            out["Host"] = resolved.host_header
            response = await self._first_target(session, method, resolved, path, out, body,
                                                timeout)
        try:
            yield response
        except BaseException:
            response.close()  # part-read: the connection cannot be reused
            raise
        response.release()

    async def _first_target(
        self, session: aiohttp.ClientSession, method: str, resolved: ResolvedServer,
        path: str, headers: dict[str, str], body: AsyncIterable[bytes] | bytes | None,
        read_timeout: aiohttp.ClientTimeout,
    ) -> aiohttp.ClientResponse:
        """The response of the first SRV target that accepts a connection (the body is
        not read before one is made)."""
        last: BaseException | None = None
        raw_path, _, query = path.partition("?")
        tls, sni = self._tls_args(resolved)
        for host, port in resolved.targets:
            self.check_literal(host)
            url = URL.build(scheme=self._scheme, host=host, port=port, path=raw_path,
                            query_string=query, encoded=True)
            proxy, proxy_auth = self._proxy_args(host)
            try:
                return await session.request(
                    method, url, data=body, headers=headers, allow_redirects=False,
                    timeout=read_timeout, proxy=proxy, proxy_headers=proxy_auth, ssl=tls,
                    server_hostname=sni,
                )
            except aiohttp.ClientConnectorError as e:
                last = e  # try the next SRV target
        assert last is not None  # discovery always yields at least one target
        raise last
