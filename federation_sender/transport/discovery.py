"""Server discovery: from a server name to where to connect, what Host to send, and
which name the TLS certificate must carry.

Theory of operation
-------------------
The server-server specification resolves a server name in this order:

1. IP literal (with or without port): connect there, port 8448 by default.
2. Hostname with an explicit port: connect to the hostname's A/AAAA at that port.
3. Otherwise fetch ``https://<hostname>/.well-known/matrix/server``; a valid
   ``{"m.server": "<delegated>[:port]"}`` is resolved by steps 1-2 for the delegated
   name, then by SRV ``_matrix-fed._tcp.<delegated>``, then the deprecated
   ``_matrix._tcp.<delegated>``, then ``<delegated>:8448``. The Host header and TLS
   name become the delegated name.
4. No valid well-known: SRV ``_matrix-fed._tcp.<hostname>``, then ``_matrix._tcp``,
   then ``<hostname>:8448``, with Host and TLS name ``<hostname>``.

The Host header carries the port exactly when the (delegated) server name did; the
TLS server name never carries one. SRV targets are only where to connect.

Caching: well-known answers are cached per their ``Cache-Control`` (``no-store``: not
at all; ``max-age`` clamped to 5 min .. 48 h; none: 24 h with +-10 % jitter). Failures
are cached too, for a bounded time: 1 h for an invalid or missing file, 2 min if the
name had a valid one before -- and for a *temporary* failure (connection error, 5xx,
timeout) a still-remembered valid delegation keeps being used. SRV answers are cached
for their TTL (clamped to 30 s .. 24 h), "no records" for 5 min, and a stale SRV answer
is used if DNS fails. Both caches are LRUs bounded by entry count.
:meth:`Discovery.cached` answers synchronously when every step is fresh in them (the
usual case once a destination has been reached): the client then starts no lookup task
and records no discovery span.

Concurrency: one lookup per server name at a time. Concurrent :meth:`Discovery.resolve`
calls for a name share one task; a caller that is cancelled does not cancel the lookup
for the others (it is shielded).

Failure modes: an invalid server name raises :class:`InvalidServerName` (permanent);
DNS failures without a stale answer raise
:class:`federation_sender.transport.dns.DnsError` (transient). A broken well-known
never fails discovery by itself: it falls through to SRV and 8448.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import random
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from federation_sender.clock import Clock
from federation_sender.errors import RemotePermanentError
from federation_sender.ids import split_server_name
from federation_sender.transport.dns import SrvAnswer, order_srv_records

logger = logging.getLogger(__name__)

DEFAULT_PORT = 8448
WELL_KNOWN_DEFAULT_CACHE_S = 24 * 3600.0
WELL_KNOWN_MIN_CACHE_S = 5 * 60.0
WELL_KNOWN_MAX_CACHE_S = 48 * 3600.0
WELL_KNOWN_INVALID_CACHE_S = 3600.0
WELL_KNOWN_DOWN_CACHE_S = 2 * 60.0
WELL_KNOWN_JITTER = 0.1
WELL_KNOWN_MAX_BYTES = 50 * 1024
SRV_MIN_CACHE_S = 30.0
SRV_MAX_CACHE_S = 24 * 3600.0
SRV_NEGATIVE_CACHE_S = 5 * 60.0
_SRV_SERVICES = ("_matrix-fed._tcp.", "_matrix._tcp.")
"""In the order they are asked; the deprecated ``_matrix`` only without ``_matrix-fed``."""


class InvalidServerName(RemotePermanentError):
    """A string that is not a valid Matrix server name."""


@dataclass(frozen=True, slots=True)
class ServerName:
    host: str
    """DNS name or IP address; IPv6 without brackets."""
    port: int | None
    is_ip: bool


@functools.lru_cache(maxsize=16384)
def parse_server_name(name: str) -> ServerName:
    """Parse ``host[:port]`` per the specification's server name grammar
    (:func:`federation_sender.ids.split_server_name`). Cached (the answer is immutable;
    an invalid name raises every time): every request looks its destination up, and a
    hostname's parse tries it as an IPv4 address first, which raises (1.9 % of the
    worker's CPU at one message a second to 415 servers)."""
    try:
        host, port, is_ip = split_server_name(name)
    except ValueError as e:
        raise InvalidServerName(str(e)) from None
    return ServerName(host, port, is_ip)


@dataclass(frozen=True, slots=True)
class ResolvedServer:
    """Where and how to reach one server name."""

    targets: tuple[tuple[str, int], ...]
    """(host, port) pairs to try in order; host is a DNS name or bare IP literal."""
    host_header: str
    tls_server_name: str


@dataclass(frozen=True, slots=True)
class WellKnownResponse:
    status: int
    headers: Mapping[str, str]
    """Lower-case header names."""
    body: bytes


class WellKnownFetchError(Exception):
    """The well-known request failed without a usable HTTP response."""

    def __init__(self, message: str, *, temporary: bool) -> None:
        super().__init__(message)
        self.temporary = temporary


WellKnownFetcher = Callable[[str], Awaitable[WellKnownResponse]]
"""``hostname -> response``; raises :class:`WellKnownFetchError` when no usable answer."""


class SrvLookup(Protocol):
    async def srv(self, name: str) -> SrvAnswer: ...


V = TypeVar("V")
_MISSING = object()


class TtlLru(Generic[V]):
    """A bounded map whose entries expire, keeping expired ones for stale use."""

    def __init__(self, max_entries: int) -> None:
        self._max = max_entries
        self._data: OrderedDict[str, tuple[V, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._data)

    def get(self, key: str, now_s: float) -> tuple[bool, V | None]:
        """``(True, value)`` for a fresh entry, else ``(False, None)``."""
        entry = self._data.get(key)
        if entry is None or entry[1] <= now_s:
            return False, None
        self._data.move_to_end(key)
        return True, entry[0]

    def get_stale(self, key: str) -> tuple[bool, V | None]:
        entry = self._data.get(key)
        return (False, None) if entry is None else (True, entry[0])

    def set(self, key: str, value: V, ttl_s: float, now_s: float) -> None:
        self._data[key] = (value, now_s + ttl_s)
        self._data.move_to_end(key)
        while len(self._data) > self._max:
            self._data.popitem(last=False)


def cache_period_from_headers(headers: Mapping[str, str]) -> float | None:
    """Seconds to cache a well-known answer per Cache-Control, or None if unspecified."""
    directives = [d.strip().lower() for d in headers.get("cache-control", "").split(",")]
    if "no-store" in directives:
        return 0.0
    for d in directives:
        name, _, value = d.partition("=")
        if name.strip() == "max-age":
            try:
                return float(int(value.strip().strip('"')))
            except ValueError:
                return None
    return None


def parse_well_known(response: WellKnownResponse) -> str | None:
    """The delegated server name from a well-known response, or None if invalid."""
    if response.status != 200:
        return None
    try:
        body = json.loads(response.body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(body, dict):
        return None
    delegated = body.get("m.server")
    if not isinstance(delegated, str):
        return None
    try:
        parse_server_name(delegated)
    except InvalidServerName:
        return None
    return delegated


class Discovery:
    """Resolves server names, with caching and one lookup per name at a time."""

    def __init__(
        self,
        *,
        srv_lookup: SrvLookup,
        fetch_well_known: WellKnownFetcher,
        clock: Clock,
        rng: random.Random | None = None,
        max_cache_entries: int = 10_000,
    ) -> None:
        self._dns = srv_lookup
        self._fetch = fetch_well_known
        self._clock = clock
        self._rng = rng or random.Random()
        self._well_known: TtlLru[str | None] = TtlLru(max_cache_entries)
        self._srv: TtlLru[SrvAnswer] = TtlLru(max_cache_entries)
        self._inflight: dict[str, asyncio.Task[ResolvedServer]] = {}

    async def resolve(self, server_name: str) -> ResolvedServer:
        task = self._inflight.get(server_name)
        if task is None:
            task = asyncio.ensure_future(self._resolve(server_name))
            self._inflight[server_name] = task
            task.add_done_callback(lambda t: self._lookup_done(server_name, t))
        return await asyncio.shield(task)

    def _lookup_done(self, server_name: str, task: asyncio.Task[ResolvedServer]) -> None:
        if self._inflight.get(server_name) is task:
            del self._inflight[server_name]
        if not task.cancelled():
            task.exception()  # retrieved: every waiter may have gone away

    async def close(self) -> None:
        tasks = list(self._inflight.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _resolve(self, server_name: str) -> ResolvedServer:
        name = parse_server_name(server_name)
        if name.is_ip or name.port is not None:
            return _direct(name, server_name)
        delegated = await self._delegation(name.host)
        if delegated is not None:
            d = parse_server_name(delegated)
            if d.is_ip or d.port is not None:
                return _direct(d, delegated)
            return await self._via_srv(d.host)
        return await self._via_srv(name.host)

    def cached(self, server_name: str) -> ResolvedServer | None:
        """What :meth:`resolve` would answer now, if that needs no lookup: an IP literal
        or explicit port, or a well-known answer (or its cached absence) and the SRV
        answers it leads to, all fresh in the caches. ``None``: a lookup is due (call
        :meth:`resolve`). Synchronous: no task, no I/O, so the caller skips the lookup's
        task and its span. Raises :class:`InvalidServerName` as :meth:`resolve` does."""
        name = parse_server_name(server_name)
        if name.is_ip or name.port is not None:
            return _direct(name, server_name)
        now = self._clock.monotonic_s()
        fresh, delegated = self._well_known.get(name.host, now)
        if not fresh:
            return None
        host = name.host
        if delegated is not None:
            d = parse_server_name(delegated)
            if d.is_ip or d.port is not None:
                return _direct(d, delegated)
            host = d.host
        for service in _SRV_SERVICES:
            fresh_srv, answer = self._srv.get(service + host, now)
            if not fresh_srv or answer is None:
                return None
            if answer.records:
                return self._srv_targets(host, answer)
        return ResolvedServer(((host, DEFAULT_PORT),), host_header=host, tls_server_name=host)

    async def _via_srv(self, host: str) -> ResolvedServer:
        for service in _SRV_SERVICES:
            answer = await self._srv_answer(service + host)
            if answer.records:
                return self._srv_targets(host, answer)
        return ResolvedServer(((host, DEFAULT_PORT),), host_header=host, tls_server_name=host)

    def _srv_targets(self, host: str, answer: SrvAnswer) -> ResolvedServer:
        ordered = order_srv_records(answer.records, self._rng)
        targets = tuple((r.target, r.port) for r in ordered)
        return ResolvedServer(targets, host_header=host, tls_server_name=host)

    async def _srv_answer(self, name: str) -> SrvAnswer:
        now = self._clock.monotonic_s()
        fresh, cached = self._srv.get(name, now)
        if fresh and cached is not None:
            return cached
        try:
            answer = await self._dns.srv(name)
        except OSError:
            has_stale, stale = self._srv.get_stale(name)
            if has_stale and stale is not None:
                logger.info("DNS failed for %s; using the stale SRV answer", name)
                return stale
            raise
        if answer.records:
            ttl = min(max(answer.ttl_s, SRV_MIN_CACHE_S), SRV_MAX_CACHE_S)
        else:
            ttl = SRV_NEGATIVE_CACHE_S
        self._srv.set(name, answer, ttl, self._clock.monotonic_s())
        return answer

    def _jittered(self, period_s: float) -> float:
        return period_s * self._rng.uniform(1 - WELL_KNOWN_JITTER, 1 + WELL_KNOWN_JITTER)

    async def _delegation(self, host: str) -> str | None:
        fresh, cached = self._well_known.get(host, self._clock.monotonic_s())
        if fresh:
            return cached
        _, previous = self._well_known.get_stale(host)
        try:
            response = await self._fetch(host)
        except WellKnownFetchError as e:
            logger.info("well-known for %s failed: %s", host, e)
            if e.temporary and previous is not None:
                self._remember(host, previous, self._jittered(WELL_KNOWN_DOWN_CACHE_S))
                return previous
            self._remember_failure(host, previous)
            return None
        if response.status >= 500:
            logger.info("well-known for %s answered %d", host, response.status)
            if previous is not None:
                self._remember(host, previous, self._jittered(WELL_KNOWN_DOWN_CACHE_S))
                return previous
            self._remember_failure(host, previous)
            return None
        delegated = parse_well_known(response)
        if delegated is None:
            logger.info("well-known for %s is absent or invalid", host)
            self._remember_failure(host, previous)
            return None
        period = cache_period_from_headers(response.headers)
        if period is None:
            period = self._jittered(WELL_KNOWN_DEFAULT_CACHE_S)
        elif period > 0:
            period = min(max(period, WELL_KNOWN_MIN_CACHE_S), WELL_KNOWN_MAX_CACHE_S)
        if period > 0:
            self._remember(host, delegated, period)
        return delegated

    def _remember(self, host: str, value: str | None, period_s: float) -> None:
        self._well_known.set(host, value, period_s, self._clock.monotonic_s())

    def _remember_failure(self, host: str, previous: str | None) -> None:
        period = WELL_KNOWN_DOWN_CACHE_S if previous is not None else WELL_KNOWN_INVALID_CACHE_S
        # The stale valid answer is overwritten: after a real "invalid" it is gone.
        self._remember(host, None, self._jittered(period))


def _direct(name: ServerName, as_written: str) -> ResolvedServer:
    return ResolvedServer(
        ((name.host, name.port or DEFAULT_PORT),),
        host_header=as_written,
        tls_server_name=name.host,
    )
