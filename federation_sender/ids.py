"""Matrix identifiers: the one place that takes them apart."""

from __future__ import annotations

import functools
import ipaddress
import re

_DNS_NAME_RE = re.compile(r"^[A-Za-z0-9.-]{1,255}$")
_PORT_RE = re.compile(r"^[0-9]{1,5}$")


def server_of(user_id: str) -> str:
    """The server part of a user (or room, event) id: ``@u:example.org`` ->
    ``example.org``, ``@u:example.org:8448`` -> ``example.org:8448``; ``""`` when there is
    no server part."""
    return user_id.split(":", 1)[1] if ":" in user_id else ""


def split_server_name(name: str) -> tuple[str, int | None, bool]:
    """``host[:port]`` by the specification's server name grammar: (host, port, whether
    the host is an IP literal), IPv6 without its brackets. Raises ``ValueError`` naming
    what is wrong (``x'--``, a ``<``, a port of 0 or 70000, junk after ``]``)."""
    if name.startswith("["):
        end = name.find("]")
        if end < 0:
            raise ValueError(f"unterminated IPv6 literal in {name!r}")
        literal, rest = name[1:end], name[end + 1 :]
        try:
            ipaddress.IPv6Address(literal)
        except ValueError:
            raise ValueError(f"invalid IPv6 literal in {name!r}") from None
        host, is_ip = literal, True
        if rest and not rest.startswith(":"):
            raise ValueError(f"junk after IPv6 literal in {name!r}")
        port_text = rest[1:] if rest else None
    else:
        host, sep, port_text_or_empty = name.partition(":")
        port_text = port_text_or_empty if sep else None
        if not _DNS_NAME_RE.match(host):
            raise ValueError(f"invalid hostname in {name!r}")
        try:
            ipaddress.IPv4Address(host)
            is_ip = True
        except ValueError:
            is_ip = False
    port = None
    if port_text is not None:
        if not _PORT_RE.match(port_text) or not 0 < int(port_text) < 65536:
            raise ValueError(f"invalid port in {name!r}")
        port = int(port_text)
    return host, port, is_ip


@functools.lru_cache(maxsize=16384)
def server_name_error(name: str) -> str | None:
    """Why ``name`` is not a server name anything can be sent to, or None when it is."""
    try:
        split_server_name(name)
    except ValueError as e:
        return str(e)
    return None
