"""Rows of the ``events`` and ``federation`` streams (tagged unions), parsed from RDATA
JSON; re-exported by ``rows.py``, where the other streams' rows live."""

from __future__ import annotations

from typing import NamedTuple

from federation_sender.replication.commands import JsonValue
from federation_sender.replication.row_checks import (
    JsonDict,
    check_bool,
    check_dict,
    check_fail,
    check_int,
    check_list,
    check_opt_str,
    check_row,
    check_str,
)

# --- events ----------------------------------------------------------------------


class EventsStreamRow(NamedTuple):
    """The ``events`` stream's event row (Synapse's ``EventsStreamEventRow``; not the stored
    event, :class:`federation_sender.model.EventRow`). ``["ev", [event_id, room_id, type,
    state_key, redacts, relates_to, membership, rejected, outlier]]``: a new event was
    persisted (or de-outliered)."""

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


def _parse_event_data(data: list[object]) -> EventsStreamRow:
    """The general path: older short rows, and precise errors."""
    s = "events"
    defaults: list[object] = [None, None, False, False]  # relates_to .. outlier
    padded = data if len(data) == 9 else [*data, *defaults[len(data) - 5 :]]
    return EventsStreamRow(
        check_str(padded[0], s),
        check_str(padded[1], s),
        check_str(padded[2], s),
        check_opt_str(padded[3], s),
        check_opt_str(padded[4], s),
        check_opt_str(padded[5], s),
        check_opt_str(padded[6], s),
        check_bool(padded[7], s),
        check_bool(padded[8], s),
    )


def parse_events_row(row: JsonValue) -> EventsStreamRow | CurrentStateRow | AllStateRow:
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
                return EventsStreamRow(e, r, t, sk, red, rel, mem, rej, out)
    s = "events"
    kind, data = check_list(row, s, range(2, 3))
    if kind == "ev":
        if type(data) is list and 5 <= len(data) <= 9:
            return _parse_event_data(data)
        if type(data) is list and len(data) > 9:  # a newer writer's longer row
            return _parse_event_data(check_row(data, s, 9, "ev"))
        raise check_fail(s, "ev data must be an array of at least 5 items")
    if kind == "state":
        room_id, typ, state_key, event_id = check_row(data, s, 4, "state")
        return CurrentStateRow(
            check_str(room_id, s),
            check_str(typ, s),
            check_str(state_key, s),
            check_opt_str(event_id, s),
        )
    if kind == "state-all":
        (room_id,) = check_row(data, s, 1, "state-all")
        return AllStateRow(check_str(room_id, s))
    raise check_fail(s, f"unknown type {kind!r}")


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
    d = check_dict(value, s)
    return Edu(
        check_str(d.get("origin"), s),
        check_str(d.get("destination"), s),
        check_str(d.get("edu_type"), s),
        check_dict(d.get("content"), s),
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


def parse_presence_fields(stream: str, f: list[object]) -> PresenceState:
    return PresenceState(
        check_str(f[0], stream),
        check_str(f[1], stream),
        check_int(f[2], stream),
        check_int(f[3], stream),
        check_int(f[4], stream),
        check_opt_str(f[5], stream),
        check_bool(f[6], stream),
    )


class PresenceDestinationsRow(NamedTuple):
    """``["pd", {"state": presence, "dests": [...]}]``: send presence to these servers."""

    state: PresenceState
    destinations: tuple[str, ...]

    def wire(self) -> JsonValue:
        return ["pd", {"state": self.state.wire(), "dests": list(self.destinations)}]


PRESENCE_KEYS = (
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
    kind, data = check_list(row, s, range(2, 3))
    if kind == "e":
        return EduRow(_parse_edu(data))
    d = check_dict(data, s)
    if kind == "k":
        key = check_list(d.get("key"), s, range(0, 64))
        return KeyedEduRow(tuple(check_str(k, s) for k in key), _parse_edu(d.get("edu")))
    if kind == "pd":
        state = check_dict(d.get("state"), s)
        fields = [state.get(k) for k in PRESENCE_KEYS]
        dests = check_list(d.get("dests"), s, range(0, 1 << 30))
        return PresenceDestinationsRow(
            parse_presence_fields(s, fields), tuple(check_str(x, s) for x in dests)
        )
    raise check_fail(s, f"unknown type {kind!r}")
