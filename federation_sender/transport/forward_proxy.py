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

A proxy is written ``[http://][user:password@]host[:port]`` (default port 1080, as
Synapse); credentials, percent-decoded, go in ``Proxy-Authorization: Basic`` on the
``CONNECT``. ``https://`` proxies (TLS to the proxy itself) are refused with one line.

The proxy's own address is not subject to the outbound IP policy (it is usually on a
private network, and configured by the operator); the remote's is not seen at all when
tunnelling, except IP literals, which are still checked. A proxy that cannot be reached
is a transient failure (the destination backs off); one that answers ``407`` gives one
``ERROR`` line naming the proxy (:class:`ProxyAuthError`), then a debug line per attempt
(a 401 to a ``CONNECT`` counts as one: tinyproxy 1.11 answers wrong credentials so).
"""

from __future__ import annotations

import base64
import ipaddress
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from urllib.parse import unquote

from federation_sender.errors import ConfigError, RemoteTransientError
from federation_sender.transport.addresses import IPNetwork, is_ip_literal

logger = logging.getLogger(__name__)

DEFAULT_PORT = 1080


class ProxyAuthError(RemoteTransientError):
    """The forward proxy answered ``407 Proxy Authentication Required``."""


def proxy_auth_message(url: str, status: int, authorization: str | None) -> str:
    """The one line a refused proxy authentication gives (no credentials in it)."""
    reason = "credentials refused" if authorization else "no credentials given"
    return f"forward proxy {url} answered {status} Proxy Authentication Required ({reason})"


class ProxyConnectError(RemoteTransientError):
    """The forward proxy refused to open the tunnel (a status other than 2xx)."""


@dataclass(frozen=True)
class ForwardProxy:
    host: str
    port: int
    username: str | None = None
    password: str | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        """Without the credentials (for aiohttp's ``proxy=`` and for logs)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def authorization(self) -> str | None:
        """``Proxy-Authorization`` value, or None without credentials."""
        if self.username is None:
            return None
        raw = f"{self.username}:{self.password or ''}".encode()
        return "Basic " + base64.b64encode(raw).decode("ascii")


def parse_proxy(key: str, value: str) -> ForwardProxy:
    """``[http://][user:password@]host[:port]``; ConfigError otherwise."""
    text = value.strip()
    scheme, sep, rest = text.partition("://")
    if not sep:
        scheme, rest = "http", text
    if scheme.lower() != "http":
        raise ConfigError(key, "an http:// proxy (https:// proxies are not supported)", value)
    rest = rest.rstrip("/")
    userinfo, at, hostport = rest.rpartition("@")
    username = password = None
    if at:
        user, _, pw = userinfo.partition(":")
        username, password = unquote(user), unquote(pw)
    host, port = hostport, DEFAULT_PORT
    if hostport.startswith("["):
        end = hostport.find("]")
        host, tail = hostport[1:end], hostport[end + 1:]
        if tail.startswith(":"):
            port = _port(key, tail[1:], value)
    elif hostport.count(":") == 1:
        host, _, port_text = hostport.partition(":")
        port = _port(key, port_text, value)
    if not host or "/" in host:
        raise ConfigError(key, "[http://][user:password@]host[:port]", _redacted(value))
    return ForwardProxy(host, port, username, password)


def _port(key: str, text: str, value: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ConfigError(key, "a port from 1 to 65535", _redacted(value))
    return int(text)


def redact_proxy(value: str) -> str:
    """A proxy setting without its credentials (for display and error messages)."""
    head, at, tail = value.rpartition("@")
    if not at:
        return value
    scheme, sep, _ = head.partition("://")
    return (scheme + sep if sep else "") + "<redacted>@" + tail


_redacted = redact_proxy


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
