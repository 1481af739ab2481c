"""Secrets out of displayed text: URLs (userinfo password, secret query parameters),
log lines and printed settings.

A leaf module (it imports nothing of ours) so that both ``config`` and
``telemetry.logging`` can use it without importing each other.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from urllib.parse import unquote

REDACTED = "<redacted>"

_URL_PASSWORD = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://[^\s/@:\"']*:)[^\s/@\"']+@")
"""``scheme://user:password@host``: the password (a database or Redis URL)."""

_SECRET_WORDS = ("password", "passwd", "pwd", "secret", "token", "key", "credential", "auth")
"""A query parameter or settings key whose name contains one of these holds a secret:
``password``, ``sslpassword``, ``access_token``, ``sslkey``, ``client_secret``..."""

_NOT_SECRET = frozenset({"sslkey", "sslcertmode", "authsource"})
"""Names that match :data:`_SECRET_WORDS` but hold paths or numbers (libpq's
``sslkey`` is the path of a key file, not the key)."""

_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    (_URL_PASSWORD, r"\1" + REDACTED + "@"),
    # Authorization: Bearer <token>
    (re.compile(r"(?i)\b(bearer)\s+[A-Za-z0-9._~+/=-]+"), r"\1 " + REDACTED),
    # X-Matrix auth header signature: sig="..."
    (re.compile(r"(?i)\b(sig)\s*=\s*\"?[A-Za-z0-9+/=_-]+\"?"), r'\1="' + REDACTED + '"'),
    # key/value secrets in JSON, repr or query strings: token=..., "password": "...",
    # sslpassword=..., client_secret=...
    (re.compile(r"(?i)(\b(?:access_token|token|[a-z_]*password|[a-z_]*passwd|[a-z_]*secret|"
                r"signing_key|private_key)[\"']?\s*[:=]\s*[\"']?)[^\"'\s,&}]+"),
     r"\1" + REDACTED),
    # Synapse signing key file lines: "ed25519 a_AbCd <base64 seed>"
    (re.compile(r"(\bed25519\s+[A-Za-z0-9_]+\s+)[A-Za-z0-9+/]{32,}={0,2}"), r"\1" + REDACTED),
)


def is_secret_name(name: str) -> bool:
    """Whether a query parameter (or settings key) named ``name`` holds a secret."""
    lowered = name.lower()
    return lowered not in _NOT_SECRET and any(w in lowered for w in _SECRET_WORDS)


def redact(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` with the given secrets and anything that looks like one replaced."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, REDACTED)
    for pattern, repl in _PATTERNS:
        text = pattern.sub(repl, text)
    return text


def redact_url(url: str) -> str:
    """``url`` for display: the password of its userinfo and the value of every secret
    query parameter (``?password=``, ``sslpassword``, ``access_token``...) replaced;
    the rest is kept as written."""
    url = _URL_PASSWORD.sub(r"\1" + REDACTED + "@", url)
    base, sep, query = url.partition("?")
    if not sep:
        return url
    query, hash_, fragment = query.partition("#")
    params = []
    for param in query.split("&"):
        name, eq, _value = param.partition("=")
        params.append(f"{name}={REDACTED}" if eq and is_secret_name(unquote(name)) else param)
    return base + sep + "&".join(params) + hash_ + fragment
