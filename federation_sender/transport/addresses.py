"""Outbound address policy: which IP addresses the federation client may connect to.

Theory of operation
-------------------
Server names come from other servers, so a hostile server (or its DNS) can point us
at our own infrastructure: ``evil.example`` resolving to ``10.0.0.5`` or
``169.254.169.254`` turns the sender into a proxy for server-side request forgery.
Every address is therefore checked *after* name resolution, at three points:

1. :class:`FilteringResolver` wraps aiohttp's resolver and drops refused addresses
   from each answer (so happy-eyeballs only tries allowed ones, and an all-refused
   answer fails with a clear :class:`AddressRefusedError`);
2. IP literals never reach a resolver in aiohttp, so callers check them with
   :meth:`AddressFilter.check` before connecting;
3. :meth:`AddressFilter.socket_factory` is handed to aiohttp's ``TCPConnector`` and
   sees the final socket address of *every* connection, including redirects: the
   last line of defence if a path above is missed.

Refused by default: every address that is not globally routable (private, loopback,
link-local, CGNAT, documentation, benchmarking, reserved, unique-local, site-local,
IPv4-mapped/translated forms), plus multicast and unspecified addresses, plus an
optional deny list of extra networks. An explicit allow list (CIDR networks) overrides
the refusal; tests allow ``127.0.0.0/8`` and
``::1``. IPv4-mapped IPv6 addresses are judged as the IPv4 address they carry.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable, Sequence
from typing import Any

from aiohttp.abc import AbstractResolver, ResolveResult

from federation_sender.errors import RemoteTransientError

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

DENIED_NETWORKS: tuple[IPNetwork, ...] = tuple(
    ipaddress.ip_network(n)
    for n in (
        "0.0.0.0/8",  # "this network"
        "10.0.0.0/8",  # private
        "100.64.0.0/10",  # carrier-grade NAT
        "127.0.0.0/8",  # loopback
        "169.254.0.0/16",  # link-local (cloud metadata services live here)
        "172.16.0.0/12",  # private
        "192.0.0.0/24",  # IETF protocol assignments
        "192.0.2.0/24",  # documentation
        "192.88.99.0/24",  # 6to4 relay anycast
        "192.168.0.0/16",  # private
        "198.18.0.0/15",  # benchmarking
        "198.51.100.0/24",  # documentation
        "203.0.113.0/24",  # documentation
        "224.0.0.0/4",  # multicast
        "240.0.0.0/4",  # reserved, and the broadcast address
        "::/128",  # unspecified
        "::1/128",  # loopback
        "64:ff9b::/96",  # IPv4/IPv6 translation: could reach any IPv4 address
        "64:ff9b:1::/48",  # local-use translation
        "100::/64",  # discard-only
        "2001::/23",  # IETF protocol assignments (incl. Teredo)
        "2001:db8::/32",  # documentation
        "2002::/16",  # 6to4: embeds an arbitrary IPv4 address
        "fc00::/7",  # unique local
        "fe80::/10",  # link-local
        "fec0::/10",  # site-local (deprecated)
        "ff00::/8",  # multicast
    )
)


class AddressRefusedError(RemoteTransientError, OSError):
    """Every address of a destination is refused by the outbound address policy.

    Also an ``OSError`` so that aiohttp treats it as a connection failure.
    """


def is_ip_literal(host: str) -> bool:
    """Whether ``host`` is an IP address as written (no brackets), not a name."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def parse_networks(values: Iterable[str]) -> tuple[IPNetwork, ...]:
    """Parse CIDR strings (a bare address means a single host); ValueError on junk."""
    return tuple(ipaddress.ip_network(v.strip(), strict=False) for v in values)


def _normalise(ip: IPAddress) -> IPAddress:
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


class AddressFilter:
    """Decides whether an IP address may be connected to."""

    def __init__(
        self, allow: Sequence[IPNetwork | str] = (), deny: Sequence[IPNetwork | str] = ()
    ) -> None:
        self._allow: tuple[IPNetwork, ...] = tuple(
            n if not isinstance(n, str) else ipaddress.ip_network(n, strict=False) for n in allow
        )
        self._deny: tuple[IPNetwork, ...] = DENIED_NETWORKS + tuple(
            n if not isinstance(n, str) else ipaddress.ip_network(n, strict=False) for n in deny
        )
        # Verdicts by address as written: the policy is fixed for the filter's life, and
        # a busy sender asks about the same few thousand addresses on every connection.
        self._verdicts: dict[str, bool] = {}
        self._exempt: set[str] = set()
        """Addresses of the forward proxies (configured by the operator, usually private)."""

    def exempt(self, address: str) -> None:
        """Let ``address`` through (a forward proxy's address, see forward_proxy.py)."""
        self._exempt.add(address)

    def is_allowed(self, address: str | IPAddress) -> bool:
        if not isinstance(address, str):
            return self._decide(address)
        verdict = self._verdicts.get(address)
        if verdict is None:
            if len(self._verdicts) >= 65_536:
                self._verdicts.clear()
            verdict = self._verdicts[address] = self._decide(address)
        return verdict

    def _decide(self, address: str | IPAddress) -> bool:
        try:
            ip = _normalise(ipaddress.ip_address(address))
        except ValueError:
            return False
        if any(ip.version == n.version and ip in n for n in self._allow):
            return True
        if ip.is_multicast or ip.is_unspecified or ip.is_reserved or not ip.is_global:
            return False
        return not any(ip.version == n.version and ip in n for n in self._deny)

    def check(self, address: str | IPAddress) -> None:
        """Raise :class:`AddressRefusedError` if ``address`` may not be used."""
        if not self.is_allowed(address):
            raise AddressRefusedError(f"address {address} is refused by the outbound policy")

    def socket_factory(self, addr_info: tuple[Any, ...]) -> socket.socket:
        """A ``TCPConnector(socket_factory=...)`` hook that checks the final address."""
        family, type_, proto, _canonname, sockaddr = addr_info
        address = str(sockaddr[0]).split("%", 1)[0]
        if address not in self._exempt:
            self.check(address)
        sock = socket.socket(family=family, type=type_, proto=proto)
        return sock


class FilteringResolver(AbstractResolver):
    """An aiohttp resolver that removes refused addresses from another's answers."""

    def __init__(
        self,
        inner: AbstractResolver,
        address_filter: AddressFilter,
        exempt_hosts: Iterable[str] = (),
    ) -> None:
        """``exempt_hosts``: names resolved without the policy (the forward proxies);
        their addresses are exempted from the socket check as they are resolved."""
        self._inner = inner
        self._filter = address_filter
        self._exempt_hosts = frozenset(h.lower() for h in exempt_hosts)

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        answers = await self._inner.resolve(host, port, family)
        if host.lower() in self._exempt_hosts:
            for a in answers:
                self._filter.exempt(a["host"].split("%", 1)[0])
            return answers
        allowed = [a for a in answers if self._filter.is_allowed(a["host"].split("%", 1)[0])]
        if not allowed:
            raise AddressRefusedError(
                f"every address of {host!r} is refused by the outbound policy"
            )
        return allowed

    async def close(self) -> None:
        await self._inner.close()
