"""Shape and type checks for RDATA rows. Each raises :class:`ProtocolError` naming the
stream, so a bad row is handled exactly like a bad line (see ``rows.py``).

Strict where Synapse is strict, tolerant of what a newer Synapse adds: a row (or the
data of a tagged row) must have at least the fields we know, each of the right type,
but trailing fields beyond those are ignored (:func:`check_row`), with one warning per
stream, row kind and length for the life of the process. Synapse adds a field to a
stream's row at the end; refusing the row would refuse every row of that stream from a
newer writer (on TCP, a reconnect per row, the position stuck).
"""

from __future__ import annotations

import logging
from typing import TypeAlias

from federation_sender.errors import ProtocolError

JsonDict: TypeAlias = dict[str, object]

log = logging.getLogger(__name__)

EXTRA_FIELDS_WARNED: set[tuple[str, str, int]] = set()
"""(stream, row kind, length) already warned about (tests clear it)."""


def check_fail(stream: str, why: str) -> ProtocolError:
    return ProtocolError(f"invalid {stream} row: {why}")


def check_list(value: object, stream: str, lengths: range) -> list[object]:
    if not isinstance(value, list) or len(value) not in lengths:
        raise check_fail(stream, f"expected an array of {lengths.start}..{lengths.stop - 1} items")
    return value


def check_row(value: object, stream: str, known: int, kind: str = "") -> list[object]:
    """The first ``known`` items of a row that must have at least that many; a longer
    row (a newer writer) is accepted with one warning, its extra items ignored."""
    if not isinstance(value, list) or len(value) < known:
        what = f"{kind} data" if kind else "row"
        raise check_fail(stream, f"{what} must be an array of at least {known} items")
    if len(value) == known:
        return value
    key = (stream, kind, len(value))
    if key not in EXTRA_FIELDS_WARNED:
        EXTRA_FIELDS_WARNED.add(key)
        log.warning(
            "replication: %s %srows have %d fields, %d known here: the extra ones are "
            "ignored (a newer Synapse?); logged once", stream, f"{kind!r} " if kind else "",
            len(value), known,
        )  # fmt: skip
    return value[:known]


def check_str(value: object, stream: str) -> str:
    if not isinstance(value, str):
        raise check_fail(stream, f"expected a string, got {type(value).__name__}")
    return value


def check_opt_str(value: object, stream: str) -> str | None:
    return None if value is None else check_str(value, stream)


def check_bool(value: object, stream: str) -> bool:
    if not isinstance(value, bool):
        raise check_fail(stream, f"expected a boolean, got {type(value).__name__}")
    return value


def check_int(value: object, stream: str) -> int:
    if type(value) is not int:
        raise check_fail(stream, f"expected an integer, got {type(value).__name__}")
    return value


def check_dict(value: object, stream: str) -> JsonDict:
    if not isinstance(value, dict):
        raise check_fail(stream, f"expected an object, got {type(value).__name__}")
    return value
