"""Matrix-style admin errors (``{"errcode": ..., "error": ...}``) and query parsing.

Handlers raise :class:`AdminError`; the error middleware renders it. Parameter parsing
follows Synapse's servlet helpers: a missing parameter takes its default, a malformed
one is a 400 ``M_INVALID_PARAM`` naming the parameter.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Any, TypeVar

from aiohttp import web

E = TypeVar("E", bound=StrEnum)


class Codes(StrEnum):
    INVALID_PARAM = "M_INVALID_PARAM"
    MISSING_PARAM = "M_MISSING_PARAM"
    NOT_FOUND = "M_NOT_FOUND"
    MISSING_TOKEN = "M_MISSING_TOKEN"
    UNKNOWN_TOKEN = "M_UNKNOWN_TOKEN"
    FORBIDDEN = "M_FORBIDDEN"
    USER_LOCKED = "M_USER_LOCKED"
    GUEST_ACCESS_FORBIDDEN = "M_GUEST_ACCESS_FORBIDDEN"
    UNRECOGNIZED = "M_UNRECOGNIZED"
    BAD_JSON = "M_BAD_JSON"
    NOT_JSON = "M_NOT_JSON"
    UNKNOWN = "M_UNKNOWN"


class AdminError(Exception):
    """``extra`` adds fields to the body, as Synapse does (``soft_logout`` on a 401)."""

    def __init__(self, status: int, errcode: Codes, error: str,
                 extra: Mapping[str, Any] | None = None) -> None:
        super().__init__(error)
        self.status = status
        self.errcode = errcode
        self.error = error
        self.extra = dict(extra or {})

    def response(self) -> web.Response:
        return error_response(self.status, self.errcode, self.error, self.extra)


def error_response(status: int, errcode: Codes, error: str,
                   extra: Mapping[str, Any] | None = None) -> web.Response:
    return web.json_response({"errcode": errcode.value, "error": error, **(extra or {})},
                             status=status)


def parse_int(query: Mapping[str, str], name: str, default: int, *, minimum: int = 0,
              maximum: int | None = None) -> int:
    raw = query.get(name)
    if raw is None:
        return default
    # int() accepts "+5", " 5" and "5_000"; Synapse's parser does not, nor do we.
    if not raw.isascii() or not raw.isdigit():
        raise AdminError(400, Codes.INVALID_PARAM,
                         f"Query parameter {name} must be a string representing a "
                         "positive integer.")
    value = int(raw)
    if value < minimum or (maximum is not None and value > maximum):
        bound = f" from {minimum} to {maximum}" if maximum is not None else f" >= {minimum}"
        raise AdminError(400, Codes.INVALID_PARAM, f"Query parameter {name} must be{bound}.")
    return value


def parse_enum(query: Mapping[str, str], name: str, enum: type[E], default: E) -> E:
    raw = query.get(name)
    if raw is None:
        return default
    try:
        return enum(raw)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in enum)
        raise AdminError(400, Codes.INVALID_PARAM,
                         f"Query parameter {name} must be one of [{allowed}]") from None


def parse_str(query: Mapping[str, str], name: str, *, max_len: int = 255) -> str | None:
    raw = query.get(name)
    if raw is None:
        return None
    if len(raw) > max_len:
        raise AdminError(400, Codes.INVALID_PARAM,
                         f"Query parameter {name} must be at most {max_len} characters.")
    return raw
