"""Typed rows of the streams this worker consumes, parsed from RDATA JSON.

Each stream's row is a JSON array (Synapse serialises an attrs tuple); a few
streams wrap a type tag around the data (``events``: ``["ev", [...]]``;
``federation``: ``["e" | "k" | "pd", {...}]``). Each ``parse_*_row`` validates
shape and types and raises :class:`ProtocolError` for anything else, so a bad
row is handled exactly like a bad line. Every row type has ``wire()``, the
inverse, used by the writer side and the simulator.

Which stream each parser reads is said once, in the worker's stream table
(:data:`federation_sender.intake.streams.STREAMS`, from which ``ROW_PARSERS`` and
``parse_row`` are derived); the replication client is given the parsers of the
streams it consumes and skips the others without parsing their rows (Synapse
publishes many we do not need).

Compatibility: ``ev`` rows from older Synapse versions had 5 to 8 fields; the
missing trailing fields default to ``None`` / ``False``. A row with more fields than
we know (a newer Synapse adds them at the end) is read by its known fields, with one
warning (``row_checks.check_row``); a missing or mistyped known field is an error.

Layout: the tagged streams' rows (``events``, ``federation``) live in
``rows_tagged.py``, the shape checks in ``row_checks.py``; every row type and parser
is importable from here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, TypeAlias

from federation_sender.replication.commands import JsonValue
from federation_sender.replication.row_checks import (
    EXTRA_FIELDS_WARNED,
    JsonDict,
    check_bool,
    check_dict,
    check_int,
    check_list,
    check_opt_str,
    check_row,
    check_str,
)
from federation_sender.replication.rows_tagged import (
    PRESENCE_KEYS,
    AllStateRow,
    CurrentStateRow,
    Edu,
    EduRow,
    EventsStreamRow,
    KeyedEduRow,
    PresenceDestinationsRow,
    PresenceState,
    parse_events_row,
    parse_federation_row,
    parse_presence_fields,
)

__all__ = [
    "EXTRA_FIELDS_WARNED",
    "AllStateRow",
    "CachesRow",
    "CurrentStateRow",
    "DeviceListsRow",
    "Edu",
    "EduRow",
    "EventsStreamRow",
    "JsonDict",
    "KeyedEduRow",
    "PresenceDestinationsRow",
    "PresenceFederationRow",
    "PresenceRow",
    "PresenceState",
    "ReceiptsRow",
    "Row",
    "RowParser",
    "ToDeviceStreamRow",
    "TypingRow",
    "parse_caches_row",
    "parse_device_lists_row",
    "parse_events_row",
    "parse_federation_row",
    "parse_presence_federation_row",
    "parse_presence_row",
    "parse_receipts_row",
    "parse_to_device_row",
    "parse_typing_row",
]


# --- the simple streams ----------------------------------------------------------


class ToDeviceStreamRow(NamedTuple):
    """``[entity]``: a local user id, or a remote server name with queued messages (not the
    outbox row, :class:`federation_sender.model.ToDeviceRow`)."""

    entity: str

    def wire(self) -> JsonValue:
        return [self.entity]


class DeviceListsRow(NamedTuple):
    """``[user_id, is_signature, hosts_calculated]``."""

    user_id: str
    is_signature: bool
    hosts_calculated: bool

    def wire(self) -> JsonValue:
        return [self.user_id, self.is_signature, self.hosts_calculated]


class ReceiptsRow(NamedTuple):
    """``[room_id, receipt_type, user_id, event_id, thread_id, data]``."""

    room_id: str
    receipt_type: str
    user_id: str
    event_id: str
    thread_id: str | None
    data: JsonDict

    def wire(self) -> JsonValue:
        return [
            self.room_id,
            self.receipt_type,
            self.user_id,
            self.event_id,
            self.thread_id,
            self.data,
        ]


class TypingRow(NamedTuple):
    """``[room_id, [user_id, ...]]``: the complete set of users typing in the room."""

    room_id: str
    user_ids: tuple[str, ...]

    def wire(self) -> JsonValue:
        return [self.room_id, list(self.user_ids)]


class PresenceFederationRow(NamedTuple):
    """``[destination, user_id]``: send this user's presence to this server."""

    destination: str
    user_id: str

    def wire(self) -> JsonValue:
        return [self.destination, self.user_id]


class CachesRow(NamedTuple):
    """``[cache_func, keys | null, invalidation_ts]``."""

    cache_func: str
    keys: tuple[object, ...] | None
    invalidation_ts: int

    def wire(self) -> JsonValue:
        return [
            self.cache_func,
            None if self.keys is None else list(self.keys),
            self.invalidation_ts,
        ]


class PresenceRow(NamedTuple):
    """``[user_id, state, last_active_ts, last_federation_update_ts, last_user_sync_ts,
    status_msg, currently_active]``."""

    state: PresenceState

    def wire(self) -> JsonValue:
        return [self.state.wire()[k] for k in PRESENCE_KEYS]


def parse_to_device_row(row: JsonValue) -> ToDeviceStreamRow:
    (entity,) = check_row(row, "to_device", 1)
    return ToDeviceStreamRow(check_str(entity, "to_device"))


def parse_device_lists_row(row: JsonValue) -> DeviceListsRow:
    s = "device_lists"
    user_id, is_sig, hosts = check_row(row, s, 3)
    return DeviceListsRow(check_str(user_id, s), check_bool(is_sig, s), check_bool(hosts, s))


def parse_receipts_row(row: JsonValue) -> ReceiptsRow:
    s = "receipts"
    room, rtype, user, event, thread, data = check_row(row, s, 6)
    return ReceiptsRow(
        check_str(room, s),
        check_str(rtype, s),
        check_str(user, s),
        check_str(event, s),
        check_opt_str(thread, s),
        check_dict(data, s),
    )


def parse_typing_row(row: JsonValue) -> TypingRow:
    s = "typing"
    room, users = check_row(row, s, 2)
    members = check_list(users, s, range(1 << 30))
    return TypingRow(check_str(room, s), tuple(check_str(u, s) for u in members))


def parse_presence_federation_row(row: JsonValue) -> PresenceFederationRow:
    s = "presence_federation"
    dest, user = check_row(row, s, 2)
    return PresenceFederationRow(check_str(dest, s), check_str(user, s))


def parse_caches_row(row: JsonValue) -> CachesRow:
    s = "caches"
    func, keys, ts = check_row(row, s, 3)
    key_tuple = None if keys is None else tuple(check_list(keys, s, range(1 << 30)))
    return CachesRow(check_str(func, s), key_tuple, check_int(ts, s))


def parse_presence_row(row: JsonValue) -> PresenceRow:
    return PresenceRow(parse_presence_fields("presence", check_row(row, "presence", 7)))


Row: TypeAlias = (
    EventsStreamRow
    | CurrentStateRow
    | AllStateRow
    | EduRow
    | KeyedEduRow
    | PresenceDestinationsRow
    | ToDeviceStreamRow
    | DeviceListsRow
    | ReceiptsRow
    | TypingRow
    | PresenceFederationRow
    | CachesRow
    | PresenceRow
)

RowParser: TypeAlias = Callable[[JsonValue], Row]
"""Reads one decoded RDATA row of a stream; ``ProtocolError`` if it is not one."""
