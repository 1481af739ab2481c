"""Forward (egress) HTTP proxies: Synapse's ``http_proxy``, ``https_proxy``, ``no_proxy``.

Theory of operation
-------------------
A deployment whose hosts may not open connections to the Internet sends outbound
federation through an HTTP proxy, as Synapse does. :class:`ProxyPolicy` decides, for
each host we are about to connect to (the SRV target or well-known host, not the server
name, as Synapse's ``MatrixHostnameEndpoint`` decides), whether to go through a proxy:

* TLS targets (every federation request) go through ``https_proxy`` with an HTTP
  ``CONNECT host:port`` tunnel, TLS to the remote inside it: the proxy sees the names
  and ports, never the content;
* plain-HTTP targets (loopback test peers only) go through ``http_proxy`` the same way;
* a host matched by ``no_proxy`` connects directly: ``*`` (every host), a name (that
  name and every name under it, a leading dot ignored), an IP address, or a CIDR range
  (matched against hosts that are IP literals; names are not resolved to decide).

A proxy is written ``[http://][user:password@]host[:port]`` (parsed by
:mod:`federation_sender.proxy_url`, which the settings validate with at load);
credentials go in ``Proxy-Authorization: Basic`` on the ``CONNECT``.

The proxy's own address is not subject to the outbound IP policy (it is usually on a
private network, and configured by the operator); the remote's is not seen at all when
tunnelling, except IP literals, which are still checked. A proxy that cannot be reached
is a transient failure (the destination backs off); one that answers ``407`` gives one
``ERROR`` line naming the proxy (:class:`ProxyAuthError`), then a debug line per attempt
(a 401 to a ``CONNECT`` counts as one: tinyproxy 1.11 answers wrong credentials so).
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import aiohttp

from federation_sender.errors import RemoteTransientError
from federation_sender.proxy_url import ForwardProxy as ForwardProxy  # re-exported
from federation_sender.proxy_url import parse_proxy as parse_proxy
from federation_sender.proxy_url import redact_proxy as redact_proxy
from federation_sender.transport.addresses import AddressFilter, IPNetwork, is_ip_literal

logger = logging.getLogger(__name__)

class ProxyAuthError(RemoteTransientError):
    """The forward proxy answered ``407 Proxy Authentication Required``."""


def proxy_auth_message(url: str, status: int, authorization: str | None) -> str:
    """The one line a refused proxy authentication gives (no credentials in it)."""
    reason = "credentials refused" if authorization else "no credentials given"
    return f"forward proxy {url} answered {status} Proxy Authentication Required ({reason})"


class ProxyConnectError(RemoteTransientError):
    """The forward proxy refused to open the tunnel (a status other than 2xx)."""




@dataclass(frozen=True)
class ProxyPolicy:
    """Which proxy, if any, a connection to a host goes through."""

    https_proxy: ForwardProxy | None = None
    http_proxy: ForwardProxy | None = None
    no_proxy: tuple[str, ...] = ()

    @classmethod
    def from_settings(
        cls, http_proxy: str | None, https_proxy: str | None, no_proxy: Iterable[str]
    ) -> ProxyPolicy:
        return cls(
            https_proxy=parse_proxy("https_proxy", https_proxy) if https_proxy else None,
            http_proxy=parse_proxy("http_proxy", http_proxy) if http_proxy else None,
            no_proxy=tuple(n.strip().lower() for n in no_proxy if n.strip()),
        )

    @property
    def enabled(self) -> bool:
        return self.https_proxy is not None or self.http_proxy is not None

    def proxy_for(self, host: str, *, tls: bool) -> ForwardProxy | None:
        proxy = self.https_proxy if tls else self.http_proxy
        if proxy is None or self.bypass(host):
            return None
        return proxy

    def bypass(self, host: str) -> bool:
        host = host.strip("[]").lower()
        literal = is_ip_literal(host)
        for entry in self.no_proxy:
            if entry == "*":
                return True
            if literal and "/" in entry:
                if _in_network(host, entry):
                    return True
                continue
            name = entry.lstrip(".")
            if host == name or (not literal and host.endswith("." + name)):
                return True
            bare = name.strip("[]")
            if literal and is_ip_literal(bare) and (
                ipaddress.ip_address(host) == ipaddress.ip_address(bare)
            ):
                return True
        return False


def _in_network(host: str, cidr: str) -> bool:
    try:
        network: IPNetwork = ipaddress.ip_network(cidr, strict=False)
        return ipaddress.ip_address(host) in network
    except ValueError:
        return False


def policy_from_environment(environ: Mapping[str, str]) -> tuple[str | None, str | None,
                                                                list[str] | None]:
    """``(http_proxy, https_proxy, no_proxy)`` from the environment, lower-case names
    first (as urllib's ``getproxies_environment``)."""

    def get(name: str) -> str | None:
        value = environ.get(name.lower())
        if value is None:
            value = environ.get(name.upper())
        return value or None

    no_proxy = get("no_proxy")
    return get("http_proxy"), get("https_proxy"), (
        no_proxy.split(",") if no_proxy is not None else None
    )


class ClientProxies:
    """The forward proxies of one federation client: their hosts, which pass the address
    policy when given as IP literals (a proxy on a private address is the operator's
    choice), and the one ERROR line for refused credentials."""

    def __init__(self, policy: ProxyPolicy | None, address_filter: AddressFilter) -> None:
        self.policy = policy if policy is not None and policy.enabled else None
        proxies = [] if self.policy is None else [
            p for p in (self.policy.https_proxy, self.policy.http_proxy) if p]
        self.hosts = tuple(p.host for p in proxies)
        for host in self.hosts:
            if is_ip_literal(host):
                address_filter.exempt(host)
        self._auth_reported = False

    def note_failure(self, exc: BaseException) -> BaseException:
        """A forward proxy's 407 (either HTTP client): one ERROR line, then per-attempt
        debug. Returns the exception to classify (aiohttp's as a :class:`ProxyAuthError`)."""
        if isinstance(exc, aiohttp.ClientHttpProxyError) and exc.status in (401, 407):
            proxy = self.policy.https_proxy if self.policy is not None else None
            exc = ProxyAuthError(proxy_auth_message(
                proxy.url if proxy is not None else "?", exc.status,
                proxy.authorization if proxy is not None else None))
        if isinstance(exc, ProxyAuthError) and not self._auth_reported:
            self._auth_reported = True
            logger.error("%s: check the credentials in https_proxy (every destination "
                         "backs off until they are accepted)", exc)
        return exc


def forward_proxy_line(http_proxy: str | None, https_proxy: str | None,
                       no_proxy: list[str]) -> str | None:
    """The start-up line that says federation goes through a forward proxy (an
    operator reading why a destination is unreachable needs to know), without its
    credentials; None without one."""
    if not http_proxy and not https_proxy:
        return None
    parts = []
    if https_proxy:
        parts.append(f"TLS federation through {parse_proxy('https_proxy', https_proxy).url} "
                     "(CONNECT)")
    if http_proxy:
        parts.append(f"plain-HTTP targets through {parse_proxy('http_proxy', http_proxy).url}")
    line = "forward proxy in use: " + "; ".join(parts)
    if no_proxy:
        line += f"; not for {', '.join(no_proxy)} (no_proxy)"
    return line

