"""rows.py: every consumed stream's rows from real captures, wire round trips, bad rows."""

from __future__ import annotations

import pytest

from federation_sender.errors import ProtocolError
from federation_sender.intake.streams import ROW_PARSERS, parse_row
from federation_sender.replication import commands as c
from federation_sender.replication import rows as r
from federation_sender.testing.captures import capture_lines


def test_capture_rows_of_consumed_streams_parse_and_round_trip() -> None:
    seen: set[str] = set()
    for line in capture_lines():
        command = c.parse_line(line)
        if isinstance(command, c.RdataCommand) and command.stream_name in ROW_PARSERS:
            row = parse_row(command.stream_name, command.row)
            assert row.wire() == command.row
            seen.add(command.stream_name)
    assert {"events", "typing", "receipts", "to_device", "device_lists", "caches"} <= seen


def test_event_row_fields() -> None:
    row = parse_row(
        "events", ["ev", ["$e", "!r", "m.room.member", "@u:hs", None, None, "join", False, True]]
    )
    assert row == r.EventsStreamRow(
        "$e", "!r", "m.room.member", "@u:hs", None, None, "join", False, True
    )


def test_old_five_field_event_rows_get_defaults() -> None:
    row = parse_row("events", ["ev", ["$e", "!r", "m.room.message", None, None]])
    assert row == r.EventsStreamRow(
        "$e", "!r", "m.room.message", None, None, None, None, False, False
    )


EDU = {"origin": "hs", "destination": "remote", "edu_type": "m.typing", "content": {"a": 1}}
PRESENCE = {
    "user_id": "@u:hs",
    "state": "online",
    "last_active_ts": 1,
    "last_federation_update_ts": 2,
    "last_user_sync_ts": 3,
    "status_msg": None,
    "currently_active": True,
}

GOOD = [
    ("events", ["state", ["!r", "m.room.name", "", "$e"]]),
    ("events", ["state-all", ["!r"]]),
    ("federation", ["e", EDU]),
    ("federation", ["k", {"key": ["!r"], "edu": EDU}]),
    ("federation", ["pd", {"state": PRESENCE, "dests": ["a", "b"]}]),
    ("to_device", ["remote.example"]),
    ("device_lists", ["@u:hs", True, False]),
    ("receipts", ["!r", "m.read", "@u:hs", "$e", None, {"ts": 1}]),
    ("typing", ["!r", ["@u:hs"]]),
    ("presence_federation", ["remote", "@u:hs"]),
    ("caches", ["get_user", None, 5]),
    ("presence", ["@u:hs", "online", 1, 2, 3, None, True]),
]


@pytest.mark.parametrize(("stream", "raw"), GOOD)
def test_rows_round_trip(stream: str, raw: object) -> None:
    assert parse_row(stream, raw).wire() == raw


BAD = [
    ("events", ["ev"]),
    ("events", ["ev", ["$e", "!r", "t", None, None, None, None, "no", False]]),
    ("events", ["ev", ["$e", "!r", "t", None]]),
    ("events", ["nope", []]),
    ("events", {"ev": 1}),
    ("federation", ["e", {"origin": "hs"}]),
    ("federation", ["k", {"key": "notalist", "edu": EDU}]),
    ("federation", ["pd", {"state": {"user_id": "@u"}, "dests": []}]),
    ("to_device", [1]),
    ("device_lists", ["@u:hs", 1, 0]),
    ("receipts", ["!r", "m.read", "@u:hs", "$e", None, []]),
    ("typing", ["!r", "@u:hs"]),
    ("presence_federation", ["remote"]),
    ("caches", ["f", None, 1.5]),
    ("caches", ["f", None, True]),
    ("push_rules", ["@u:hs"]),
]


@pytest.mark.parametrize(("stream", "raw"), BAD)
def test_bad_rows_raise_protocol_error(stream: str, raw: object) -> None:
    with pytest.raises(ProtocolError):
        parse_row(stream, raw)


LONGER = [(stream, [*raw, "added later"]) for stream, raw in GOOD if stream not in (
    "events", "federation")] + [
    ("events", ["ev", ["$e", "!r", "t", None, None, None, None, False, False, {"x": 1}]]),
    ("events", ["state", ["!r", "m.room.name", "", "$e", 7]]),
    ("events", ["state-all", ["!r", None]]),
]


@pytest.mark.parametrize(("stream", "raw"), LONGER)
def test_rows_longer_than_known_are_read_by_their_known_fields(
    stream: str, raw: list[object], caplog: pytest.LogCaptureFixture
) -> None:
    """What a newer Synapse adds at the end of a row is ignored, with one warning per
    stream, kind and length; the known fields are checked as strictly as before."""
    r.EXTRA_FIELDS_WARNED.clear()
    caplog.set_level("WARNING", logger="federation_sender.replication")
    tagged = stream == "events"
    known = [raw[0], raw[1][:-1]] if tagged else raw[:-1]
    if raw[0] == "ev":
        known = [raw[0], raw[1][:9]]
    assert parse_row(stream, raw) == parse_row(stream, known)
    assert parse_row(stream, raw) == parse_row(stream, known)  # warned once only
    assert len([m for m in caplog.messages if "extra ones are ignored" in m]) == 1


STILL_BAD = [
    ("events", ["ev", ["$e", "!r", "t", None, None, None, None, "no", False, "extra"]]),
    ("events", ["ev", [1, "!r", "t", None, None, None, None, False, False, "extra"]]),
    ("events", ["ev", ["$e", "!r", "t"]]),
    ("events", ["state", ["!r", "m.room.name", ""]]),
    ("events", ["ev", ["$e", "!r", "t", None, None, None, None, False, False], "third"]),
    ("events", ["ev2", ["$e"]]),
    ("receipts", ["!r", "m.read", "@u:hs", "$e", None, [], "extra"]),
    ("typing", ["!r"]),
]


@pytest.mark.parametrize(("stream", "raw"), STILL_BAD)
def test_missing_or_mistyped_known_fields_are_still_errors(stream: str, raw: object) -> None:
    with pytest.raises(ProtocolError):
        parse_row(stream, raw)
