"""Turning an HTTP response or a failure into a :class:`SendResult` the queue can act on.

Theory of operation
-------------------
Pure functions, no I/O. The queue engine only needs four answers:

============================  =========  ===============================================
what happened                 outcome    why
============================  =========  ===============================================
200 with a JSON object        SUCCESS    per-PDU errors from ``pdus`` are reported
200, not JSON / wrong type    TRANSIENT  unknown whether it was accepted; the txn id
                                         makes a retry idempotent
413                           TOO_LARGE  split and retry the halves
429                           TRANSIENT  with ``retry_after_ms`` / ``Retry-After``
408, 5xx, 3xx (never          TRANSIENT  the remote may recover or be reconfigured
followed), other 1xx/2xx
401, 403, 410, other 4xx      PERMANENT  the same bytes will be refused again
timeout, connection error,    TRANSIENT  including TLS failures and addresses refused
reset mid-body, DNS failure,             by the outbound policy (DNS may change), as
oversized response                       Synapse backs off on all of these
invalid server name           PERMANENT  it will never resolve
============================  =========  ===============================================

Error strings are short and log-safe: remote text is truncated and stripped of
control characters; nothing we sent (the Authorization header) is ever included.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import Mapping
from typing import Any

import aiohttp
import orjson

from federation_sender.errors import RemoteTransientError
from federation_sender.transport.addresses import AddressRefusedError
from federation_sender.transport.discovery import InvalidServerName
from federation_sender.transport.dns import DnsError
from federation_sender.transport.forward_proxy import ProxyAuthError, ProxyConnectError
from federation_sender.transport.result import Outcome, SendResult

MAX_ERROR_CHARS = 200
MAX_RETRY_AFTER_S = 24 * 3600.0


class ResponseTooLarge(RemoteTransientError):
    """The response body exceeded the configured limit."""


class InvalidResponse(RemoteTransientError):
    """The peer's bytes are not an HTTP/1.x response we accept (transport/h1.py)."""


class Disconnected(RemoteTransientError):
    """The connection ended before the response was complete (transport/h1.py)."""

    def __init__(self, message: str, *, started: bool) -> None:
        super().__init__(message)
        self.started = started
        """Whether any byte of a response had arrived."""


class CouldNotConnect(RemoteTransientError):
    """No connection to one target (transport/h1.py); ``cause``: the last address's
    failure, which is what gets classified."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"could not connect: {type(cause).__name__}: {cause}")
        self.cause = cause


def sanitise(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    cleaned = "".join(c if c.isprintable() else "?" for c in text)
    return cleaned if len(cleaned) <= limit else cleaned[: limit - 1] + "…"


def _json_object(body: bytes) -> dict[str, Any] | None:
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        # orjson refuses some JSON the standard library reads (integers beyond 64
        # bits, NaN, nesting past 1024): let that decide.
        try:
            parsed = json.loads(body)
        except (ValueError, UnicodeDecodeError, RecursionError):
            return None
    return parsed if isinstance(parsed, dict) else None


def _is_json(headers: Mapping[str, str]) -> bool:
    media_type = headers.get("content-type", "").split(";", 1)[0].strip().lower()
    return media_type == "application/json"


def retry_after_s(body: Mapping[str, Any] | None, headers: Mapping[str, str]) -> float | None:
    """From the body's ``retry_after_ms``, else a delta-seconds ``Retry-After`` header."""
    value: float | None = None
    if body is not None:
        ms = body.get("retry_after_ms")
        if isinstance(ms, int | float) and not isinstance(ms, bool):
            value = ms / 1000.0
    if value is None:
        header = headers.get("retry-after", "").strip()
        if header.isdigit():
            value = float(header)
    if value is None or value != value:  # NaN
        return None
    return min(max(value, 0.0), MAX_RETRY_AFTER_S)


def parse_pdu_errors(body: Mapping[str, Any]) -> dict[str, str]:
    """``event_id -> error`` for every PDU result in a 200 body that carries an error."""
    pdus = body.get("pdus")
    if not isinstance(pdus, dict):
        return {}
    errors: dict[str, str] = {}
    for event_id, result in pdus.items():
        if isinstance(result, dict) and "error" in result:
            errors[sanitise(str(event_id))] = sanitise(str(result["error"]))
    return errors


def classify_response(status: int, headers: Mapping[str, str], body: bytes) -> SendResult:
    """Classify a complete response; ``headers`` has lower-case names."""
    parsed = _json_object(body) if _is_json(headers) else None
    if status == 200:
        if parsed is None:
            reason = "not a JSON object" if _is_json(headers) else "not application/json"
            return SendResult(Outcome.TRANSIENT, status, f"200 response body is {reason}")
        return SendResult(Outcome.SUCCESS, status, pdu_errors=parse_pdu_errors(parsed))

    errcode = parsed.get("errcode") if parsed is not None else None
    errcode = sanitise(errcode, 64) if isinstance(errcode, str) else None
    message = parsed.get("error") if parsed is not None else None
    error = f"HTTP {status}"
    if errcode:
        error += f" {errcode}"
    if isinstance(message, str) and message:
        error += f": {sanitise(message)}"

    if status == 413:
        outcome = Outcome.TOO_LARGE
    elif status == 429:
        return SendResult(
            Outcome.TRANSIENT,
            status,
            error,
            errcode,
            retry_after_s=retry_after_s(parsed, headers),
        )
    elif status == 408 or status >= 500 or status < 400:
        outcome = Outcome.TRANSIENT
    else:
        outcome = Outcome.PERMANENT
    return SendResult(outcome, status, error, errcode)


def classify_exception(exc: BaseException) -> SendResult:
    """Classify a failure that produced no complete response."""
    if isinstance(exc, aiohttp.ClientConnectorError) and isinstance(
        exc.os_error, AddressRefusedError | DnsError
    ):
        exc = exc.os_error  # aiohttp's wrapper hides the reason we care about
    if isinstance(exc, CouldNotConnect):
        exc = exc.cause
    if isinstance(exc, ProxyAuthError | ProxyConnectError):
        return SendResult(Outcome.TRANSIENT, error=sanitise(str(exc)))
    if isinstance(exc, InvalidServerName):
        return SendResult(Outcome.PERMANENT, error=sanitise(str(exc)))
    if isinstance(exc, AddressRefusedError | DnsError):
        return SendResult(Outcome.TRANSIENT, error=sanitise(str(exc)))
    if isinstance(exc, ResponseTooLarge):
        return SendResult(Outcome.TRANSIENT, error=sanitise(str(exc)))
    if isinstance(exc, TimeoutError | asyncio.TimeoutError | aiohttp.ServerTimeoutError):
        return SendResult(Outcome.TRANSIENT, error="timed out")
    if isinstance(exc, aiohttp.ClientSSLError | ssl.SSLError):
        return SendResult(Outcome.TRANSIENT, error=f"TLS failure: {sanitise(str(exc))}")
    if isinstance(exc, InvalidResponse):
        return SendResult(Outcome.TRANSIENT, error=f"invalid HTTP response: {exc.message}")
    if isinstance(exc, Disconnected):
        return SendResult(Outcome.TRANSIENT, error=exc.message)
    if isinstance(exc, aiohttp.ClientPayloadError):
        return SendResult(Outcome.TRANSIENT, error="connection broken while reading the body")
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return SendResult(Outcome.TRANSIENT, error="server disconnected")
    if isinstance(exc, aiohttp.ClientResponseError):
        return SendResult(Outcome.TRANSIENT, error=f"invalid HTTP response: {exc.message}")
    if isinstance(exc, aiohttp.ClientConnectorError):
        # Its own text carries the TLS context's repr ("ssl:<ssl.SSLContext object at
        # 0x…>"): the address and the system's reason are what an operator needs.
        reason = exc.os_error.strerror or type(exc.os_error).__name__
        return SendResult(Outcome.TRANSIENT, error=sanitise(
            f"connection failed: cannot connect to {exc.host}:{exc.port}: {reason}"))
    if isinstance(exc, aiohttp.ClientError | OSError):
        return SendResult(
            Outcome.TRANSIENT, error=sanitise(f"connection failed: {type(exc).__name__}: {exc}")
        )
    return SendResult(Outcome.TRANSIENT, error=sanitise(f"unexpected {type(exc).__name__}"))
