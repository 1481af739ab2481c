"""DNS lookups for federation: SRV records for discovery, A/AAAA for connecting.

Theory of operation
-------------------
Discovery needs SRV records (``_matrix-fed._tcp.<host>``), which the system
resolver (``getaddrinfo``) cannot answer, so :class:`DnsLookup` uses dnspython's
asyncio resolver. By default it reads the system configuration; given explicit
nameservers (``host``/``port`` pairs) it asks only those, which is how the tests
point it at a DNS server on loopback.

Address (A/AAAA) lookups for connecting go through an aiohttp resolver:
:class:`DnsPythonResolver` when explicit nameservers are configured (tests), otherwise
aiohttp's default resolver, so ``/etc/hosts`` keeps working in production. Either is
wrapped in :class:`federation_sender.transport.addresses.FilteringResolver`.

Failure modes: a name that does not exist, or has no records of the type asked, is an
empty answer (not an error); timeouts and server failures raise :class:`DnsError`
(transient), which discovery may paper over with a stale cached answer.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Sequence
from dataclasses import dataclass

import dns.asyncresolver
import dns.exception
import dns.inet
import dns.rdatatype
import dns.resolver
from aiohttp.abc import AbstractResolver, ResolveResult

from federation_sender.errors import RemoteTransientError

Nameserver = tuple[str, int]


class DnsError(RemoteTransientError, OSError):
    """A DNS lookup failed (timeout, SERVFAIL, no nameserver answered)."""


@dataclass(frozen=True, slots=True)
class SrvRecord:
    priority: int
    weight: int
    port: int
    target: str
    """Without the trailing dot."""


@dataclass(frozen=True, slots=True)
class SrvAnswer:
    records: tuple[SrvRecord, ...]
    ttl_s: float


class DnsLookup:
    """SRV and address lookups with dnspython."""

    def __init__(
        self, nameservers: Sequence[Nameserver] | None = None, *, timeout_s: float = 5.0
    ) -> None:
        if nameservers:
            self._resolver = dns.asyncresolver.Resolver(configure=False)
            self._resolver.nameservers = [host for host, _ in nameservers]
            # dnspython has one port for all nameservers; explicit ones share a port.
            self._resolver.port = nameservers[0][1]
        else:
            self._resolver = dns.asyncresolver.Resolver()
        self._resolver.lifetime = timeout_s
        self._resolver.cache = None  # discovery caches with its own, bounded, policy

    async def _query(self, name: str, rdtype: str) -> dns.resolver.Answer | None:
        try:
            return await self._resolver.resolve(name, rdtype, search=False)
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            return None
        except dns.exception.DNSException as e:
            raise DnsError(f"DNS {rdtype} lookup for {name!r} failed: {type(e).__name__}") from e

    async def srv(self, name: str) -> SrvAnswer:
        answer = await self._query(name, "SRV")
        if answer is None or answer.rrset is None:
            return SrvAnswer((), 0.0)
        records = tuple(
            SrvRecord(r.priority, r.weight, r.port, r.target.to_text(omit_final_dot=True))
            for r in answer
        )
        # A single record with target "." means "no such service here" (RFC 2782).
        records = tuple(r for r in records if r.target not in ("", "."))
        return SrvAnswer(records, float(answer.rrset.ttl))

    async def addresses(self, host: str) -> list[str]:
        """A and AAAA addresses of ``host``, IPv6 first (it is tried first anyway)."""
        out: list[str] = []
        for rdtype in ("AAAA", "A"):
            answer = await self._query(host, rdtype)
            if answer is not None:
                out.extend(r.to_text() for r in answer)
        return out


def order_srv_records(records: Sequence[SrvRecord], rng: random.Random) -> list[SrvRecord]:
    """Order SRV records by priority, then weighted-randomly within a priority (RFC 2782)."""
    out: list[SrvRecord] = []
    for priority in sorted({r.priority for r in records}):
        group = [r for r in records if r.priority == priority]
        while group:
            total = sum(r.weight for r in group)
            if total == 0:
                pick = group[0]
            else:
                point = rng.uniform(0, total)
                running = 0
                pick = group[-1]
                for r in group:
                    running += r.weight
                    if running >= point:
                        pick = r
                        break
            out.append(pick)
            group.remove(pick)
    return out


class DnsPythonResolver(AbstractResolver):
    """An aiohttp resolver answering from :class:`DnsLookup` (for explicit nameservers)."""

    def __init__(self, lookup: DnsLookup) -> None:
        self._lookup = lookup

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        results: list[ResolveResult] = []
        for address in await self._lookup.addresses(host):
            af = (
                socket.AF_INET6
                if dns.inet.af_for_address(address) == socket.AF_INET6
                else (socket.AF_INET)
            )
            if family not in (socket.AF_UNSPEC, af):
                continue
            results.append(
                {
                    "hostname": host,
                    "host": address,
                    "port": port,
                    "family": af,
                    "proto": 0,
                    "flags": socket.AI_NUMERICHOST,
                }
            )
        if not results:
            raise DnsError(f"no addresses found for {host!r}")
        return results

    async def close(self) -> None:
        return None
