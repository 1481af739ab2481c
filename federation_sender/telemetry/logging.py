"""Structured logs: context fields from contextvars, text or JSON, secrets redacted.

``with log_context(destination=d, txn_id=t):`` makes every record logged inside it
(including in tasks created inside it, which copy the context) carry those fields.
:class:`ContextFilter` copies them onto each record; the formatters render them and
then pass the whole rendered line, exception text included, through
:func:`redact`, so a secret cannot leak through a traceback or a ``repr``.

The text format is one line per record, whatever the record holds. A destination
name, an admin API path or a message argument comes from outside, and a line break in
one would start a line of its sender's choosing (a forged timestamp and level). So every
field of a text line, the message with its arguments included, is passed through
:func:`escape_controls`: CR, LF, ESC and the rest of C0 and C1 (and DEL, U+2028 and
U+2029) become visible escapes such as ``\\n``. A traceback keeps its lines, but
each one after the first is indented and escaped the same way, so only a record's first
line starts at the left margin. JSON lines need none of this: ``json.dumps`` escapes
control characters itself.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from collections.abc import Iterable, Mapping
from contextvars import ContextVar, Token
from datetime import UTC, datetime
from types import MappingProxyType
from typing import IO, Any

from federation_sender.config import TelemetrySettings
from federation_sender.redaction import redact

_EMPTY: Mapping[str, Any] = MappingProxyType({})
_context: ContextVar[Mapping[str, Any]] = ContextVar("federation_sender_log_context",
                                                     default=_EMPTY)

CONTEXT_KEYS_FIRST = ("destination", "txn_id")
"""Rendered first, and always present in JSON (null when unset)."""

class LogContext:
    """The context manager :func:`log_context` returns. A class rather than a
    generator: one is entered per transaction, and every live queue holds two while it
    waits, so a generator frame each (with its kwargs) was 8 % of a queue's memory."""

    __slots__ = ("_fields", "_token")

    def __init__(self, fields: dict[str, Any]) -> None:
        self._fields: dict[str, Any] | None = fields
        self._token: Token[Mapping[str, Any]] | None = None

    def __enter__(self) -> None:
        fields, self._fields = self._fields or {}, None  # merged below: not kept twice
        merged = {**_context.get(), **{k: v for k, v in fields.items() if v is not None}}
        self._token = _context.set(MappingProxyType(merged))

    def __exit__(self, *exc: object) -> None:
        if self._token is not None:
            _context.reset(self._token)
            self._token = None


def log_context(**fields: Any) -> LogContext:
    """Add fields to every log record within the block; ``None`` values are dropped."""
    return LogContext(fields)


def current_log_context() -> Mapping[str, Any]:
    return _context.get()


class ContextFilter(logging.Filter):
    """Attach the current log context to the record as ``record.context``."""

    def filter(self, record: logging.LogRecord) -> bool:
        ctx = dict(_context.get())
        extra = getattr(record, "context", None)
        if isinstance(extra, Mapping):
            ctx.update(extra)
        record.context = ctx
        return True


def _ordered(ctx: Mapping[str, Any]) -> list[tuple[str, Any]]:
    first = [(k, ctx[k]) for k in CONTEXT_KEYS_FIRST if k in ctx]
    return first + sorted((k, v) for k, v in ctx.items() if k not in CONTEXT_KEYS_FIRST)


class _RedactingFormatter(logging.Formatter):
    def __init__(self, secrets: Iterable[str] = ()) -> None:
        super().__init__()
        self.secrets = tuple(s for s in secrets if s)

    def _context_of(self, record: logging.LogRecord) -> Mapping[str, Any]:
        ctx = getattr(record, "context", None)
        return ctx if isinstance(ctx, Mapping) else _context.get()

    @staticmethod
    def _timestamp(record: logging.LogRecord) -> str:
        stamp = datetime.fromtimestamp(record.created, UTC)
        return stamp.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _control_escapes() -> dict[int, str]:
    table = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F, *range(0x80, 0xA0))}
    table.update({0x09: "\\t", 0x0A: "\\n", 0x0D: "\\r", 0x1B: "\\x1b"})
    table.update({0x2028: "\\u2028", 0x2029: "\\u2029"})
    return table


_CONTROL_ESCAPES = _control_escapes()
_HAS_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def escape_controls(text: str) -> str:
    """``text`` with every control character (C0, DEL, C1, U+2028/9) as a visible
    escape: ``"a\\nb"`` becomes ``a\\nb`` on one line. Backslashes are kept as they
    are, so an escape cannot be told from the same characters typed literally; what
    matters here is that no line break or terminal sequence gets through."""
    if _HAS_CONTROL.search(text) is None:
        return text
    return text.translate(_CONTROL_ESCAPES)


def _indented(text: str) -> str:
    """A traceback's or stack's lines, each escaped and indented as a continuation."""
    return "".join("\n    " + escape_controls(line) for line in text.split("\n"))


class TextFormatter(_RedactingFormatter):
    """``2024-01-01T00:00:00.000Z INFO name [destination=d txn_id=t] message``, one
    physical line per record (but for an indented traceback); see the module docstring
    for why every field is escaped."""

    def format(self, record: logging.LogRecord) -> str:
        ctx = self._context_of(record)
        fields = " ".join(f"{escape_controls(str(k))}={escape_controls(str(v))}"
                          for k, v in _ordered(ctx))
        line = (f"{self._timestamp(record)} {escape_controls(record.levelname)} "
                f"{escape_controls(record.name)}")
        if fields:
            line += f" [{fields}]"
        line += " " + escape_controls(record.getMessage())
        if record.exc_info:
            line += _indented(self.formatException(record.exc_info))
        if record.stack_info:
            line += _indented(self.formatStack(record.stack_info))
        return redact(line, self.secrets)


class JsonFormatter(_RedactingFormatter):
    """One JSON object per line: ts, level, logger, message, destination, txn_id,
    any other context fields, and exc_info when present."""

    def format(self, record: logging.LogRecord) -> str:
        ctx = self._context_of(record)
        out: dict[str, Any] = {
            "ts": self._timestamp(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key in CONTEXT_KEYS_FIRST:
            out[key] = ctx.get(key)
        for key, value in _ordered(ctx):
            out.setdefault(key, value)
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        return redact(json.dumps(out, default=str, ensure_ascii=False), self.secrets)


_HANDLER_NAME = "federation_sender"


def setup_logging(settings: TelemetrySettings, *, stream: IO[str] | None = None,
                  secrets: Iterable[str] = ()) -> logging.Handler:
    """Configure the root logger: one handler (replacing one installed earlier by this
    function), the configured level and format. ``secrets`` (the admin token, for
    example) are redacted wherever they appear."""
    root = logging.getLogger()
    for existing in list(root.handlers):
        if existing.get_name() == _HANDLER_NAME:
            root.removeHandler(existing)
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.set_name(_HANDLER_NAME)
    handler.addFilter(ContextFilter())
    formatter = JsonFormatter(secrets) if settings.log_format == "json" else TextFormatter(
        secrets)
    handler.setFormatter(formatter)
    root.addHandler(handler)
    root.setLevel(settings.log_level)
    # Per-request access lines would drown the federation lines; errors still show.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    # Alembic announces its dialect and each step at INFO; migrate says what changed.
    logging.getLogger("alembic").setLevel(logging.WARNING)
    # aiosqlite logs every cursor operation at DEBUG.
    logging.getLogger("aiosqlite").setLevel(logging.INFO)
    return handler
