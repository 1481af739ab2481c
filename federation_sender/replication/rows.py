"""Typed rows of the streams this worker consumes, parsed from RDATA JSON.

Each stream's row is a JSON array (Synapse serialises an attrs tuple); a few
streams wrap a type tag around the data (``events``: ``["ev", [...]]``;
``federation``: ``["e" | "k" | "pd", {...}]``). :func:`parse_row` validates
shape and types and raises :class:`ProtocolError` for anything else, so a bad
row is handled exactly like a bad line. Every row type has ``wire()``, the
inverse, used by the writer side and the simulator.

Streams not in :data:`ROW_PARSERS` are not consumed; the reader skips them
without parsing their rows (Synapse publishes many we do not need).

Compatibility: ``ev`` rows from older Synapse versions had 5 to 8 fields; the
missing trailing fields default to ``None`` / ``False``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, TypeAlias

from federation_sender.errors import ProtocolError
from federation_sender.replication.commands import JsonValue

JsonDict: TypeAlias = dict[str, object]


def _fail(stream: str, why: str) -> ProtocolError:
    return ProtocolError(f"invalid {stream} row: {why}")


def _list(value: object, stream: str, lengths: range) -> list[object]:
    if not isinstance(value, list) or len(value) not in lengths:
        raise _fail(stream, f"expected an array of {lengths.start}..{lengths.stop - 1} items")
    return value


def _str(value: object, stream: str) -> str:
    if not isinstance(value, str):
        raise _fail(stream, f"expected a string, got {type(value).__name__}")
    return value


def _opt_str(value: object, stream: str) -> str | None:
    return None if value is None else _str(value, stream)


def _bool(value: object, stream: str) -> bool:
    if not isinstance(value, bool):
        raise _fail(stream, f"expected a boolean, got {type(value).__name__}")
    return value


def _int(value: object, stream: str) -> int:
    if type(value) is not int:
        raise _fail(stream, f"expected an integer, got {type(value).__name__}")
    return value


def _dict(value: object, stream: str) -> JsonDict:
    if not isinstance(value, dict):
        raise _fail(stream, f"expected an object, got {type(value).__name__}")
    return value


# --- events ----------------------------------------------------------------------


class EventRow(NamedTuple):
    """``["ev", [event_id, room_id, type, state_key, redacts, relates_to, membership,
    rejected, outlier]]``: a new event was persisted (or de-outliered)."""

    event_id: str
    room_id: str
    type: str
    state_key: str | None
    redacts: str | None
    relates_to: str | None
    membership: str | None
    rejected: bool
    outlier: bool

    def wire(self) -> JsonValue:
        return [
            "ev",
            [
                self.event_id,
                self.room_id,
                self.type,
                self.state_key,
                self.redacts,
                self.relates_to,
                self.membership,
                self.rejected,
                self.outlier,
            ],
        ]


class CurrentStateRow(NamedTuple):
    """``["state", [room_id, type, state_key, event_id]]``: current state changed."""

    room_id: str
    type: str
    state_key: str
    event_id: str | None

    def wire(self) -> JsonValue:
        return ["state", [self.room_id, self.type, self.state_key, self.event_id]]


class AllStateRow(NamedTuple):
    """``["state-all", [room_id]]``: too many state changes; invalidate the room."""

    room_id: str

    def wire(self) -> JsonValue:
        return ["state-all", [self.room_id]]


def _parse_event_data(data: list[object]) -> EventRow:
    """The general path: older short rows, and precise errors."""
    s = "events"
    defaults: list[object] = [None, None, False, False]  # relates_to .. outlier
    padded = data if len(data) == 9 else [*data, *defaults[len(data) - 5 :]]
    return EventRow(
        _str(padded[0], s),
        _str(padded[1], s),
        _str(padded[2], s),
        _opt_str(padded[3], s),
        _opt_str(padded[4], s),
        _opt_str(padded[5], s),
        _opt_str(padded[6], s),
        _bool(padded[7], s),
        _bool(padded[8], s),
    )


def parse_events_row(row: JsonValue) -> EventRow | CurrentStateRow | AllStateRow:
    if type(row) is list and len(row) == 2 and row[0] == "ev":
        data = row[1]
        if type(data) is list and len(data) == 9:
            # The hot path, inlined: every field of the common shape checked here.
            e, r, t, sk, red, rel, mem, rej, out = data
            if (
                type(e) is str
                and type(r) is str
                and type(t) is str
                and (sk is None or type(sk) is str)
                and (red is None or type(red) is str)
                and (rel is None or type(rel) is str)
                and (mem is None or type(mem) is str)
                and type(rej) is bool
                and type(out) is bool
            ):
                return EventRow(e, r, t, sk, red, rel, mem, rej, out)
    s = "events"
    kind, data = _list(row, s, range(2, 3))
    if kind == "ev":
        if type(data) is list and 5 <= len(data) <= 9:
            return _parse_event_data(data)
        raise _fail(s, "ev data must be an array of 5..9 items")
    if kind == "state":
        room_id, typ, state_key, event_id = _list(data, s, range(4, 5))
        return CurrentStateRow(
            _str(room_id, s), _str(typ, s), _str(state_key, s), _opt_str(event_id, s)
        )
    if kind == "state-all":
        (room_id,) = _list(data, s, range(1, 2))
        return AllStateRow(_str(room_id, s))
    raise _fail(s, f"unknown type {kind!r}")


# --- federation ------------------------------------------------------------------


class Edu(NamedTuple):
    origin: str
    destination: str
    edu_type: str
    content: JsonDict

    def wire(self) -> JsonDict:
        return {
            "origin": self.origin,
            "destination": self.destination,
            "edu_type": self.edu_type,
            "content": self.content,
        }


def _parse_edu(value: object) -> Edu:
    s = "federation"
    d = _dict(value, s)
    return Edu(
        _str(d.get("origin"), s),
        _str(d.get("destination"), s),
        _str(d.get("edu_type"), s),
        _dict(d.get("content"), s),
    )


class EduRow(NamedTuple):
    """``["e", edu]``: send this EDU."""

    edu: Edu

    def wire(self) -> JsonValue:
        return ["e", self.edu.wire()]


class KeyedEduRow(NamedTuple):
    """``["k", {"key": [...], "edu": edu}]``: a newer EDU with the same key replaces it."""

    key: tuple[str, ...]
    edu: Edu

    def wire(self) -> JsonValue:
        return ["k", {"key": list(self.key), "edu": self.edu.wire()}]


class PresenceState(NamedTuple):
    user_id: str
    state: str
    last_active_ts: int
    last_federation_update_ts: int
    last_user_sync_ts: int
    status_msg: str | None
    currently_active: bool

    def wire(self) -> JsonDict:
        return {
            "user_id": self.user_id,
            "state": self.state,
            "last_active_ts": self.last_active_ts,
            "last_federation_update_ts": self.last_federation_update_ts,
            "last_user_sync_ts": self.last_user_sync_ts,
            "status_msg": self.status_msg,
            "currently_active": self.currently_active,
        }


def _parse_presence_fields(stream: str, f: list[object]) -> PresenceState:
    return PresenceState(
        _str(f[0], stream),
        _str(f[1], stream),
        _int(f[2], stream),
        _int(f[3], stream),
        _int(f[4], stream),
        _opt_str(f[5], stream),
        _bool(f[6], stream),
    )


class PresenceDestinationsRow(NamedTuple):
    """``["pd", {"state": presence, "dests": [...]}]``: send presence to these servers."""

    state: PresenceState
    destinations: tuple[str, ...]

    def wire(self) -> JsonValue:
        return ["pd", {"state": self.state.wire(), "dests": list(self.destinations)}]


_PRESENCE_KEYS = (
    "user_id",
    "state",
    "last_active_ts",
    "last_federation_update_ts",
    "last_user_sync_ts",
    "status_msg",
    "currently_active",
)


def parse_federation_row(row: JsonValue) -> EduRow | KeyedEduRow | PresenceDestinationsRow:
    s = "federation"
    kind, data = _list(row, s, range(2, 3))
    if kind == "e":
        return EduRow(_parse_edu(data))
    d = _dict(data, s)
    if kind == "k":
        key = _list(d.get("key"), s, range(0, 64))
        return KeyedEduRow(tuple(_str(k, s) for k in key), _parse_edu(d.get("edu")))
    if kind == "pd":
        state = _dict(d.get("state"), s)
        fields = [state.get(k) for k in _PRESENCE_KEYS]
        dests = _list(d.get("dests"), s, range(0, 1 << 30))
        return PresenceDestinationsRow(
            _parse_presence_fields(s, fields), tuple(_str(x, s) for x in dests)
        )
    raise _fail(s, f"unknown type {kind!r}")


# --- the simple streams ----------------------------------------------------------


class ToDeviceRow(NamedTuple):
    """``[entity]``: a local user id, or a remote server name with queued messages."""

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
        return [self.state.wire()[k] for k in _PRESENCE_KEYS]


def parse_to_device_row(row: JsonValue) -> ToDeviceRow:
    (entity,) = _list(row, "to_device", range(1, 2))
    return ToDeviceRow(_str(entity, "to_device"))


def parse_device_lists_row(row: JsonValue) -> DeviceListsRow:
    s = "device_lists"
    user_id, is_sig, hosts = _list(row, s, range(3, 4))
    return DeviceListsRow(_str(user_id, s), _bool(is_sig, s), _bool(hosts, s))


def parse_receipts_row(row: JsonValue) -> ReceiptsRow:
    s = "receipts"
    room, rtype, user, event, thread, data = _list(row, s, range(6, 7))
    return ReceiptsRow(
        _str(room, s),
        _str(rtype, s),
        _str(user, s),
        _str(event, s),
        _opt_str(thread, s),
        _dict(data, s),
    )


def parse_typing_row(row: JsonValue) -> TypingRow:
    s = "typing"
    room, users = _list(row, s, range(2, 3))
    return TypingRow(_str(room, s), tuple(_str(u, s) for u in _list(users, s, range(1 << 30))))


def parse_presence_federation_row(row: JsonValue) -> PresenceFederationRow:
    s = "presence_federation"
    dest, user = _list(row, s, range(2, 3))
    return PresenceFederationRow(_str(dest, s), _str(user, s))


def parse_caches_row(row: JsonValue) -> CachesRow:
    s = "caches"
    func, keys, ts = _list(row, s, range(3, 4))
    key_tuple = None if keys is None else tuple(_list(keys, s, range(1 << 30)))
    return CachesRow(_str(func, s), key_tuple, _int(ts, s))


def parse_presence_row(row: JsonValue) -> PresenceRow:
    return PresenceRow(_parse_presence_fields("presence", _list(row, "presence", range(7, 8))))


Row: TypeAlias = (
    EventRow
    | CurrentStateRow
    | AllStateRow
    | EduRow
    | KeyedEduRow
    | PresenceDestinationsRow
    | ToDeviceRow
    | DeviceListsRow
    | ReceiptsRow
    | TypingRow
    | PresenceFederationRow
    | CachesRow
    | PresenceRow
)

ROW_PARSERS: dict[str, Callable[[JsonValue], Row]] = {
    "events": parse_events_row,
    "federation": parse_federation_row,
    "to_device": parse_to_device_row,
    "device_lists": parse_device_lists_row,
    "receipts": parse_receipts_row,
    "typing": parse_typing_row,
    "presence_federation": parse_presence_federation_row,
    "caches": parse_caches_row,
    "presence": parse_presence_row,
}
"""The streams the worker consumes, by name."""


def parse_row(stream_name: str, row: JsonValue) -> Row:
    """Parse a decoded RDATA row of a consumed stream; ``ProtocolError`` if invalid."""
    parser = ROW_PARSERS.get(stream_name)
    if parser is None:
        raise ProtocolError(f"stream {stream_name!r} is not consumed")
    return parser(row)
