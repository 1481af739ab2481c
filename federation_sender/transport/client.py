"""The federation client: signed ``PUT /_matrix/federation/v1/send/{txnId}``.

Theory of operation
-------------------
:class:`FederationClient` implements
:class:`federation_sender.transport.result.TransactionSender`. One call of
:meth:`FederationClient.send_transaction` is one *attempt*:

1. refuse locally (``TOO_LARGE``) a transaction over 50 PDUs or 100 EDUs, so the
   queue splits it instead of the remote answering 400;
2. build the body (``origin``, ``origin_server_ts``, ``pdus``, ``edus``) as canonical
   JSON and sign the request (X-Matrix) over those same bytes, once per transaction
   content: a retry of a transient failure reuses both
   (:mod:`federation_sender.transport.prepare`);
3. discover the destination (or use a test override), then try its targets in order
   until one accepts a connection; the Host header and the TLS server name come from
   discovery, never from the SRV target;
4. read at most ``max_response_bytes`` of the response, never follow a redirect, and
   classify (:mod:`federation_sender.transport.classify`).

Every attempt runs under one hard deadline (``attempt_timeout_s``) covering discovery,
connecting, sending and reading: nothing outlives it, whatever the remote does. The
deadline is enforced with ``asyncio.timeout`` on the event loop's clock -- a real
network cannot be paused by a fake clock; the injected :class:`Clock` timestamps the
body and measures durations. Every attempt has the same length, so one timer expires
them all (:mod:`federation_sender.transport.deadlines`) instead of one each.

The request goes over the built-in HTTP/1.1 client (:mod:`federation_sender.transport.h1`,
the default) or over aiohttp (``http_client="aiohttp"``,
:mod:`federation_sender.transport.aiohttp_requests`, which also carries ``GET /event``,
the outbound proxy's forwards and well-known discovery). Both pool connections
(``max_connections`` in total, ``max_connections_per_host`` per host/port/TLS name),
resolve through the address policy (:mod:`federation_sender.transport.addresses`) and
verify TLS (:mod:`federation_sender.transport.tls_choice`) unless a test turns it off.

``send_transaction`` never raises for anything the remote or the network does; it
returns a :class:`SendResult`. Remote per-PDU errors are logged and counted in
:attr:`FederationClient.stats`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import AsyncIterable, AsyncIterator, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from types import TracebackType
from typing import Literal
from urllib.parse import quote

import aiohttp
from aiohttp.abc import AbstractResolver
from opentelemetry import trace

from federation_sender.clock import Clock
from federation_sender.errors import FederationSenderError
from federation_sender.telemetry import names
from federation_sender.telemetry.tracing import child_span_dropped, leaf_span
from federation_sender.transport.addresses import (
    AddressFilter,
    FilteringResolver,
    IPNetwork,
)
from federation_sender.transport.aiohttp_requests import AiohttpRequests, event_held
from federation_sender.transport.classify import (
    CouldNotConnect,
    classify_exception,
    classify_response,
)
from federation_sender.transport.deadlines import Deadlines
from federation_sender.transport.discovery import (
    Discovery,
    ResolvedServer,
)
from federation_sender.transport.dns import DnsLookup, DnsPythonResolver, Nameserver
from federation_sender.transport.domain_metrics import DomainMetrics
from federation_sender.transport.encoding import signing_bytes
from federation_sender.transport.forward_proxy import ClientProxies, ProxyPolicy
from federation_sender.transport.h1 import Http1Pool, get_head, request_head
from federation_sender.transport.http import WellKnownClient
from federation_sender.transport.overrides import Overrides
from federation_sender.transport.prepare import SEND_PATH, PreparedRequest, RequestBuilder
from federation_sender.transport.result import EventHeld, Outcome, SendResult, Transaction
from federation_sender.transport.signing import SigningKey, sign_request_bytes
from federation_sender.transport.stats import RequestCounter, TransportStats
from federation_sender.transport.tls_choice import TlsChoice

logger = logging.getLogger(__name__)

MAX_PDUS_PER_TXN = 50
MAX_EDUS_PER_TXN = 100
EVENT_PATH = "/_matrix/federation/v1/event/"
VERSION_PATH = "/_matrix/federation/v1/version"

__all__ = ["EVENT_PATH", "SEND_PATH", "FederationClient", "TransportStats"]

_NO_SPAN: AbstractContextManager[trace.Span] = nullcontext(trace.INVALID_SPAN)


class FederationClient:
    """Sends transactions to remote homeservers. Use ``async with`` or start/close.

    Settings are explicit; the test-only ones are marked.

    ``nameservers``: ask only these (host, port) DNS servers, for SRV and A/AAAA;
    default: the system configuration (``/etc/hosts`` honoured for A/AAAA).
    ``well_known_port`` (tests only): where well-known is fetched instead of 443.
    ``destination_overrides`` (tests only): ``destination -> "host:port"`` skipping
    discovery; the Host header stays the destination, the TLS name is the host.
    ``tls_verify=False`` (tests only) disables certificate verification.
    ``plain_http=True`` (tests and the demo only) speaks HTTP without TLS, to
    loopback fake homeservers.
    ``http_client``: ``/send`` over the built-in HTTP/1.1 pool
    (:mod:`federation_sender.transport.h1`) or over aiohttp (well-known discovery
    always uses aiohttp).
    ``tls_ca_files``: Synapse's ``federation_custom_ca_list`` (replace the system
    CAs); ``tls_min_version``: ``"1"`` to ``"1.3"``; ``tls_unverified_names``: globs
    of TLS server names whose certificates are not checked
    (``federation_certificate_verification_whitelist``); ``proxy_policy``: forward
    proxies (:mod:`federation_sender.transport.forward_proxy`).
    """

    def __init__(
        self,
        *,
        server_name: str,
        signing_key: SigningKey,
        clock: Clock,
        attempt_timeout_s: float = 60.0,
        connect_timeout_s: float = 10.0,
        well_known_timeout_s: float = 10.0,
        max_connections: int = 100,
        max_connections_per_host: int = 4,
        max_response_bytes: int = 1024 * 1024,
        tls_verify: bool = True,
        tls_extra_ca_file: str | None = None,
        ip_allow_list: Sequence[IPNetwork | str] = (),
        ip_deny_list: Sequence[IPNetwork | str] = (),
        nameservers: Sequence[Nameserver] | None = None,
        well_known_port: int = 443,
        destination_overrides: Mapping[str, str] | None = None,
        user_agent: str = "federation-sender",
        plain_http: bool = False,
        http_client: Literal["builtin", "aiohttp"] = "builtin",
        tls_ca_files: Sequence[str] = (),
        tls_min_version: str | None = None,
        tls_unverified_names: Sequence[str] = (),
        proxy_policy: ProxyPolicy | None = None,
    ) -> None:
        self._server_name = server_name
        self._https = not plain_http
        self._key = signing_key
        self._clock = clock
        self._attempt_timeout_s = attempt_timeout_s
        self._deadlines = Deadlines(attempt_timeout_s)
        self._connect_timeout_s = connect_timeout_s
        self._well_known_timeout_s = well_known_timeout_s
        self._max_connections = max_connections
        self._max_per_host = max_connections_per_host
        self._max_response_bytes = max_response_bytes
        self._tls = TlsChoice(verify=tls_verify, extra_ca_file=tls_extra_ca_file,
                              ca_files=tls_ca_files, min_version=tls_min_version,
                              unverified_names=tls_unverified_names)
        self._ssl = self._tls.default
        self._unverified = self._tls.unverified
        self._filter = AddressFilter(ip_allow_list, ip_deny_list)
        self._proxies = ClientProxies(proxy_policy, self._filter)
        self._proxy = self._proxies.policy
        self._dns = DnsLookup(nameservers)
        self._explicit_nameservers = bool(nameservers)
        self._well_known_port = well_known_port
        self._overrides = Overrides(destination_overrides)
        self._user_agent = user_agent
        self._http_client = http_client
        self._h1: Http1Pool | None = None
        self._aiohttp = AiohttpRequests(
            https=self._https, tls=self._tls, address_filter=self._filter, proxy=self._proxy,
            resolver=self._resolver, max_connections=max_connections,
            max_per_host=max_connections_per_host, connect_timeout_s=connect_timeout_s,
            max_response_bytes=max_response_bytes, user_agent=user_agent)
        self._discovery: Discovery | None = None
        self.requests = RequestBuilder(origin=server_name, key=signing_key, clock=clock)
        self.stats = TransportStats()
        self.request_counter: RequestCounter | None = None
        self.domain_metrics: DomainMetrics | None = None
        """``federation_metrics_domains``: told of each accepted transaction."""
        self.tracer: trace.Tracer = trace.NoOpTracer()
        """Discovery (when it looks anything up) and each HTTP request are spanned
        with it, as children of the caller's current span (the transaction attempt)."""

    @property
    def signature_counts(self) -> tuple[int, int]:
        """(transaction signatures computed, those over another destination's
        content): ``RequestBuilder.signatures`` and ``.shared``, for the metrics."""
        return self.requests.signatures, self.requests.shared

    @property
    def attempt_bound_s(self) -> float:
        """Every :meth:`send_transaction` returns within this many seconds of the event
        loop's clock (its own deadline covers all it awaits): a caller whose bound is
        no shorter, on the same clock, need not add a timer of its own
        (:func:`~federation_sender.transport.result.attempt_bound_s`)."""
        return self._attempt_timeout_s

    @property
    def server_name(self) -> str:
        return self._server_name

    @property
    def address_filter(self) -> AddressFilter:
        return self._filter

    async def start(self) -> None:
        if self._aiohttp.session is not None:
            return
        session = self._aiohttp.start()
        well_known = WellKnownClient(
            session,
            self._filter,
            ssl_setting=self._tls.for_name if self._tls.per_name else self._tls.default,
            timeout_s=self._well_known_timeout_s,
            port=self._well_known_port,
            user_agent=self._user_agent,
            proxy_policy=self._proxy,
        )
        self._discovery = Discovery(
            srv_lookup=self._dns, fetch_well_known=well_known.fetch, clock=self._clock
        )
        if self._http_client == "builtin":
            self._h1 = Http1Pool(
                ssl_for=self._tls.context_for if self._tls.per_name else None,
                proxy_policy=self._proxy,
                address_filter=self._filter,
                resolver=self._resolver(),
                ssl_context=self._tls.default_context if self._https else None,
                connect_timeout_s=self._connect_timeout_s,
                max_connections=self._max_connections,
                max_per_host=self._max_per_host,
                max_response_bytes=self._max_response_bytes,
            )

    def _resolver(self) -> FilteringResolver:
        inner: AbstractResolver = (
            DnsPythonResolver(self._dns)
            if self._explicit_nameservers
            else aiohttp.resolver.DefaultResolver()
        )
        return FilteringResolver(inner, self._filter, exempt_hosts=self._proxies.hosts)

    def _ssl_for(self, tls_name: str | None) -> ssl.SSLContext | bool:
        """The TLS policy for a server name: unverified if the whitelist matches it."""
        return self._tls.for_name(tls_name)

    async def close(self) -> None:
        self._deadlines.close()
        if self._discovery is not None:
            await self._discovery.close()
        if self._h1 is not None:
            await self._h1.close()
        await self._aiohttp.close()
        self._discovery = None
        self._h1 = None

    async def __aenter__(self) -> FederationClient:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def resolve(self, destination: str) -> ResolvedServer:
        """Where ``destination`` is reached (override or discovery)."""
        resolved = self.resolve_cached(destination)
        return resolved if resolved is not None else await self._lookup(destination)

    def resolve_cached(self, destination: str) -> ResolvedServer | None:
        """Where ``destination`` is reached, if no lookup is needed to know it (an
        override, or discovery's fresh cached answers); ``None``: call :meth:`resolve`."""
        resolved = self._overrides.get(destination)
        if resolved is not None:
            return resolved
        if self._discovery is None:
            raise RuntimeError("FederationClient used before start()")
        return self._discovery.cached(destination)

    async def _lookup(self, destination: str) -> ResolvedServer:
        if self._discovery is None:
            raise RuntimeError("FederationClient used before start()")
        return await self._discovery.resolve(destination)

    def forget_destination(self, destination: str) -> None:
        """The queue engine dropped ``destination``'s idle queue: let go of what is
        cached for it alone, so memory follows the active destinations (100,000 that
        sent once keep nothing). Discovery's results stay, under their TTL: a lookup
        is worth keeping."""
        self.requests.forget_destination(destination)
        resolved = self._overrides.forget(destination)
        if resolved is not None:
            for host, port in resolved.targets:
                self._aiohttp.forget(host, port)

    def holds(self, destination: str) -> bool:
        """Whether anything is cached for ``destination`` alone (discovery aside)."""
        return self._overrides.holds(destination) or self.requests.holds(destination)

    @contextlib.asynccontextmanager
    async def open_stream(
        self,
        method: str,
        destination: str,
        path: str,
        headers: Mapping[str, str],
        body: AsyncIterable[bytes] | bytes | None,
        *,
        timeout_s: float,
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """Any request to ``destination`` (the outbound federation proxy's forward),
        yielding the response with its body unread: the caller streams it. Over aiohttp
        (see :meth:`AiohttpRequests.open_stream`)."""
        async with self._aiohttp.open_stream(
            method, lambda: self.resolve(destination), path, headers, body,
            timeout_s=timeout_s,
        ) as response:
            yield response

    async def send_transaction(self, txn: Transaction) -> SendResult:
        started = self._clock.monotonic_s()
        self.stats.attempts += 1
        if len(txn.pdus) > MAX_PDUS_PER_TXN or len(txn.edus) > MAX_EDUS_PER_TXN:
            result = SendResult(
                Outcome.TOO_LARGE,
                error=f"{len(txn.pdus)} PDUs / {len(txn.edus)} EDUs exceed "
                f"{MAX_PDUS_PER_TXN} / {MAX_EDUS_PER_TXN}",
            )
            return self._finish(txn, result, 0, started)
        prepared = self.requests.prepare(txn)
        try:
            # asyncio.timeout(None) with one shared timer for every attempt (deadlines.py).
            async with asyncio.timeout(None) as timeout:
                key = self._deadlines.watch(timeout)
                try:
                    result = await self._attempt(txn.destination, prepared)
                finally:
                    self._deadlines.unwatch(key)
        except TimeoutError:
            result = SendResult(
                Outcome.TRANSIENT, error=f"no response within {self._attempt_timeout_s:g} s"
            )
        except (FederationSenderError, aiohttp.ClientError, OSError, ValueError) as e:
            result = classify_exception(self._proxies.note_failure(e))
        except Exception as e:
            # The contract is "never raise for what the remote does": aiohttp can
            # surface odd exception types for hostile input. Log it fully, classify
            # as transient so the queue backs off rather than dying.
            logger.exception("unexpected failure sending %s to %s", txn.txn_id, txn.destination)
            result = classify_exception(e)
        self.requests.finished(txn.destination, result.outcome)
        return self._finish(txn, result, len(prepared.body), started)

    async def event_persisted(self, destination: str, event_id: str) -> EventHeld:
        """Whether ``destination`` holds ``event_id``: ``GET /_matrix/federation/v1/
        event/{eventId}``, signed (see :func:`event_held`). Never raises for what the
        remote does; the caller bounds the wait (``queue/core/pacing.py``)."""
        got = await self._get(destination, EVENT_PATH + quote(event_id, safe=""))
        if got is None:
            return EventHeld.NO_ANSWER
        status, body = got
        if status != 200 and status != 404:
            logger.debug("GET event %s from %s: HTTP %d", event_id, destination, status)
        return event_held(status, body)

    async def server_answers(self, destination: str) -> bool:
        """Whether ``destination`` is back: ``GET /_matrix/federation/v1/version``
        answered with any status below 500 (a 5xx is a proxy or a server still down).
        Through the same discovery, egress rules and kept-alive connections as
        ``/send``; a few hundred bytes each way. Never raises for what the remote does;
        the caller bounds the wait (``queue/core/destination.py``, the return probe)."""
        got = await self._get(destination, VERSION_PATH)
        return got is not None and got[0] < 500

    async def _get(self, destination: str, path: str) -> tuple[int, bytes] | None:
        """A signed ``GET`` of ``path``: (status, body), or None without an answer."""
        # The request object's canonical bytes, signed directly (no JSON round trip).
        auth = sign_request_bytes(
            key=self._key, origin=self.server_name, destination=destination,
            message=signing_bytes(content=None, destination=destination, method="GET",
                                  origin=self.server_name, uri=path))
        try:
            resolved = self.resolve_cached(destination) or await self._lookup(destination)
            if self._h1 is not None:
                # Over the connection /send keeps alive (a round trip, no handshake);
                # bounded by the caller's deadline, not a second timer of ours.
                host, port = resolved.targets[0]
                response = await self._h1.put(
                    host, port, resolved.tls_server_name,
                    get_head(path, resolved.host_header, auth, self._user_agent), b"")
                return response.status, response.body
            return await self._aiohttp.get(resolved, path, auth, self._attempt_timeout_s)
        except (TimeoutError, FederationSenderError, aiohttp.ClientError, OSError,
                ValueError) as e:
            logger.debug("GET %s from %s: %s", path, destination, e)
            return None

    def _finish(
        self, txn: Transaction, result: SendResult, size: int, started: float
    ) -> SendResult:
        # Positional construction: dataclasses.replace introspects the fields per call.
        result = SendResult(
            result.outcome, result.status, result.error, result.errcode,
            result.retry_after_s, result.pdu_errors, size,
            self._clock.monotonic_s() - started,
        )
        self.stats.record(txn, result)
        if result.outcome is Outcome.SUCCESS and self.domain_metrics is not None:
            self.domain_metrics.transaction_accepted(txn.destination, txn.pdus)
        return result

    async def _attempt(self, destination: str, prepared: PreparedRequest) -> SendResult:
        tracer = self.tracer
        # Tracing off, or this transaction not sampled: open no span at all (and do
        # not build their attributes); ``INVALID_SPAN`` takes the calls below.
        untraced = child_span_dropped(tracer)
        try:
            resolved = self.resolve_cached(destination)
            if resolved is None:
                # Spanned only when discovery does work (well-known, SRV): a cached
                # answer takes microseconds, a span of it only costs.
                with (_NO_SPAN if untraced else tracer.start_as_current_span(
                        names.SPAN_DISCOVERY,
                        attributes={names.ATTR_DESTINATION: destination})):
                    resolved = await self._lookup(destination)
        except (FederationSenderError, OSError, ValueError) as e:
            return classify_exception(e)
        last_failure: SendResult | None = None
        for host, port in resolved.targets:
            try:
                with (_NO_SPAN if untraced else leaf_span(
                        tracer, names.SPAN_HTTP_REQUEST, trace.SpanKind.CLIENT,
                        {names.ATTR_HTTP_METHOD: "PUT", names.ATTR_SERVER_ADDRESS: host,
                         names.ATTR_SERVER_PORT: port})) as span:
                    if self._h1 is not None:
                        result = await self._put_h1(self._h1, host, port, resolved, prepared)
                    else:
                        result = await self._put_aiohttp(host, port, resolved, prepared)
                    if result.status is not None:
                        span.set_attribute(names.ATTR_HTTP_STATUS, result.status)
                        if result.status >= 400:
                            span.set_status(trace.Status(trace.StatusCode.ERROR))
                    return result
            except CouldNotConnect as e:
                last_failure = classify_exception(e.cause)  # try the next SRV target
            except (aiohttp.ClientConnectorError, OSError) as e:
                if self._h1 is not None:
                    raise  # the connection broke after it was made
                # Could not connect (or refused by policy): try the next SRV target.
                last_failure = classify_exception(e)
                if isinstance(e, aiohttp.ClientOSError) and not isinstance(
                    e, aiohttp.ClientConnectorError
                ):
                    return last_failure  # the connection broke after it was made
        assert last_failure is not None  # discovery always yields at least one target
        return last_failure

    async def _put_h1(self, pool: Http1Pool, host: str, port: int,
                      resolved: ResolvedServer, prepared: PreparedRequest) -> SendResult:
        counter = self.request_counter
        if counter is not None:
            counter.http_request("PUT")
        head = request_head(prepared.path, resolved.host_header, prepared.authorization,
                            self._user_agent, len(prepared.body))
        response = await pool.put(host, port, resolved.tls_server_name, head, prepared.body)
        if counter is not None:
            counter.http_response("PUT", response.status)
        return classify_response(response.status, response.headers, response.body)

    async def _put_aiohttp(self, host: str, port: int, resolved: ResolvedServer,
                           prepared: PreparedRequest) -> SendResult:
        counter = self.request_counter
        if counter is None:
            return await self._aiohttp.put(host, port, resolved, prepared, None)
        counter.http_request("PUT")
        return await self._aiohttp.put(host, port, resolved, prepared,
                                       lambda status: counter.http_response("PUT", status))
