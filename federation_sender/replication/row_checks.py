"""Shape and type checks for RDATA rows. Each raises :class:`ProtocolError` naming the
stream, so a bad row is handled exactly like a bad line (see ``rows.py``)."""

from __future__ import annotations

from typing import TypeAlias

from federation_sender.errors import ProtocolError

JsonDict: TypeAlias = dict[str, object]


def check_fail(stream: str, why: str) -> ProtocolError:
    return ProtocolError(f"invalid {stream} row: {why}")


def check_list(value: object, stream: str, lengths: range) -> list[object]:
    if not isinstance(value, list) or len(value) not in lengths:
        raise check_fail(stream, f"expected an array of {lengths.start}..{lengths.stop - 1} items")
    return value


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
