"""Forward proxy settings' values: ``[http://][user:password@]host[:port]``.

The default port is 1080, as Synapse's; credentials are percent-decoded. ``https://``
proxies (TLS to the proxy itself) are refused with one line. The settings
(:mod:`federation_sender.config`) check the values with :func:`parse_proxy` at load; the
transport (:mod:`federation_sender.transport.forward_proxy`) uses what it returns.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from urllib.parse import unquote

from federation_sender.errors import ConfigError

DEFAULT_PORT = 1080


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
